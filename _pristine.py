"""A pristine tree of a vLLM release from its wheel alone: the wheel's Python
sources and the dist-info apply.py reads, without a venv of that release.

``apply.py lint`` and the tooling tests check each base's series against a
pristine tree of that base's vLLM. ``.venv-VERSION`` is one (11 GiB, what
`make lint` and `make setup BASE=VERSION` build); this is the cheap one that
`make test` builds for each other base (`make pristine`): the wheel that
`pip download --no-deps` fetches, of which only ``vllm/**.py`` and the
dist-info's METADATA and RECORD are unpacked (the compiled extensions play
no part in patching). Every file is checked against the wheel's RECORD and
every file the base's series patches against its ``base.sha256`` before the
tree is renamed into place: a wheel of other bytes leaves nothing behind.

    python3 _pristine.py WHEEL DEST    # DEST: .cache/pristine-vllm-VERSION
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["main", "unpack"]

PROJECT_DIR = Path(__file__).resolve().parent


def record_digests(wheel: zipfile.ZipFile, dist_info: str) -> dict[str, str]:
    """SHA-256 (hex) of every file the wheel's RECORD lists a digest for."""
    text = wheel.read(f"{dist_info}/RECORD").decode()
    digests = {}
    for row in csv.reader(io.StringIO(text)):
        if len(row) >= 2 and row[1].startswith("sha256="):
            raw = base64.urlsafe_b64decode(row[1][len("sha256=") :] + "==")
            digests[row[0]] = raw.hex()
    return digests


def series_manifest(version: str) -> dict[str, str]:
    """``base.sha256`` of this project's series for vLLM ``version``."""
    import apply

    manifest = apply.bases(PROJECT_DIR)[version] / "base.sha256"
    digests = {}
    for line in manifest.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            digest, rel = line.split(None, 1)
            digests[rel.strip()] = digest
    return digests


def unpack(wheel_path: Path, dest: Path) -> str:
    """Unpack ``wheel_path``'s pristine tree into ``dest`` (which must not
    exist), checked; return its vLLM version."""
    if dest.exists():
        raise SystemExit(f"{dest}: exists; remove it to unpack again")
    with zipfile.ZipFile(wheel_path) as wheel:
        names = wheel.namelist()
        dist_infos = {n.split("/", 1)[0] for n in names if ".dist-info/" in n}
        if len(dist_infos) != 1 or not next(iter(dist_infos)).startswith("vllm-"):
            raise SystemExit(f"{wheel_path}: not a vLLM wheel ({sorted(dist_infos)})")
        dist_info = dist_infos.pop()
        version = dist_info[len("vllm-") : -len(".dist-info")]
        record = record_digests(wheel, dist_info)
        wanted = [n for n in names if n.startswith("vllm/") and n.endswith(".py")]
        wanted += [f"{dist_info}/METADATA", f"{dist_info}/RECORD"]
        manifest = series_manifest(version)
        missing = sorted(set(manifest) - set(wanted))
        if missing:
            raise SystemExit(
                f"{wheel_path}: lacks {', '.join(missing)}, which the vLLM "
                f"{version} series patches"
            )
        dest.parent.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f"{dest.name}-", dir=dest.parent))
        try:
            for name in wanted:
                data = wheel.read(name)
                digest = hashlib.sha256(data).hexdigest()
                if name in record and digest != record[name]:
                    raise SystemExit(
                        f"{wheel_path}: {name} is not the file its RECORD lists"
                    )
                if name in manifest and digest != manifest[name]:
                    raise SystemExit(
                        f"{wheel_path}: {name} is not the vLLM {version} file "
                        "the series' base.sha256 pins"
                    )
                path = stage / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
            stage.rename(dest)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    return version


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    wheel, dest = map(Path, args)
    version = unpack(wheel, dest)
    print(f"{dest}: the Python sources of the vLLM {version} wheel, checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
