"""The model's weights between the checkpoint and the runner: the weight plan (`plan.py`: how
every linear is stored and which kernel applies it, decided once), preparing the loaded arrays
into that plan's weights (`prepare.py`), and the calibration run W8A8's smoothing reads
(`calibration.py`)."""
