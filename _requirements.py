"""The requirements `make setup` installs beside a vLLM wheel: the wheel's own
(its METADATA's ``Requires-Dist``), with the replacements ``setup.cfg`` names
for that release.

vLLM 0.34.0 pins ``flashinfer-python==0.7.3``, which the package index this
project is built from does not serve (pip: "No matching distribution found"),
so pip cannot install the wheel with its dependencies. `make setup` installs
these requirements, then the wheel itself without dependencies; every other
pin of the release is kept as it is.

    python3 _requirements.py WHEEL VERSION    # requirement lines on stdout
"""

from __future__ import annotations

import configparser
import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path

__all__ = ["main", "replacements", "requirements"]

SETUP_CFG = Path(__file__).resolve().parent / "setup.cfg"


def replacements(version: str, setup_cfg: Path = SETUP_CFG) -> dict[str, str]:
    """``replace-VERSION`` of ``[k3_sppp]``: one ``OLD -> NEW`` per line."""
    config = configparser.ConfigParser()
    config.read(setup_cfg)
    text = config.get("k3_sppp", f"replace-{version}", fallback="")
    pairs = {}
    for line in filter(None, (raw.strip() for raw in text.splitlines())):
        old, arrow, new = line.partition("->")
        if not arrow or not old.strip() or not new.strip():
            raise ValueError(
                f"{setup_cfg}: replace-{version}: {line!r} is not `OLD -> NEW`"
            )
        pairs[old.strip()] = new.strip()
    return pairs


def requirements(wheel: Path, replace: dict[str, str]) -> list[str]:
    """The wheel's unconditional requirements (no extras), replaced where
    ``replace`` says; a replacement the wheel does not require is an error,
    so a stale line in setup.cfg is seen."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = HeaderParser().parsestr(archive.read(name).decode())
    wanted = [r for r in metadata.get_all("Requires-Dist") or [] if "extra ==" not in r]
    unused = sorted(set(replace) - set(wanted))
    if unused:
        raise ValueError(
            f"{wheel.name} does not require {', '.join(unused)}: remove it from "
            f"the replace- lines of {SETUP_CFG}"
        )
    return [replace.get(r, r) for r in wanted]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.rsplit("\n\n", 1)[-1].strip(), file=sys.stderr)
        return 2
    try:
        lines = requirements(Path(args[0]), replacements(args[1]))
    except (OSError, ValueError, StopIteration, zipfile.BadZipFile) as error:
        print(f"_requirements.py: {error}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
