"""`pip install .` in a fresh virtual environment gives the `specviz` and `specviz-page` commands, and the installed
package finds its own assets and kernel sources wherever it is run from (not the checkout's)."""

from __future__ import annotations

import shutil
import subprocess
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _checkout_copy(dest: Path) -> Path:
    """The tracked (and new, unignored) files, as a clean clone has them; pip's in-tree build writes into the copy."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def test_pip_install_gives_both_commands(tmp_path):
    source = _checkout_copy(tmp_path / "src")
    env_dir = tmp_path / "venv"
    # the system's site-packages: torch and the rest are already here; pip checks the declared ranges
    # against them instead of downloading gigabytes again
    venv.create(env_dir, system_site_packages=True, with_pip=True)
    bin_dir = env_dir / "bin"
    install = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", str(source)],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    cli = subprocess.run([str(bin_dir / "specviz"), "--help"], cwd=elsewhere, capture_output=True, text=True,
                         timeout=300)
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert "generate" in cli.stdout and "compare" in cli.stdout and "eval" in cli.stdout
    page = subprocess.run([str(bin_dir / "specviz-page"), "--help"], cwd=elsewhere, capture_output=True, text=True,
                          timeout=300)
    assert page.returncode == 0 and "--host" in page.stdout, page.stderr[-3000:]

    probe = ("import specviz, specviz.paths as p\n"
             "from specviz.text.prompts import sample_article\n"
             "print(specviz.__file__); print(p.ASSETS); print(p.KERNELS)\n"
             "assert len(sample_article()) > 500\n"
             "assert (p.ASSETS / 'sample_speech.flac').stat().st_size > 100_000\n"
             "assert (p.ASSETS / 'eval' / 'text' / 'manifest.jsonl').is_file()\n"
             "from specviz.native import SOURCES, HEADERS\n"
             "assert all(f.is_file() and f.parent == p.KERNELS / 'cpu' for f in SOURCES + HEADERS), SOURCES + HEADERS\n"
             "assert (p.KERNELS / 'cuda' / 'verify.cu').is_file()\n"
             "from specviz.verify import project_kernels\n"
             "k = project_kernels()\n"
             "assert k.source_files() == [p.KERNELS / 'cuda' / 'verify.cu'] and k.available() in (True, False)\n")
    out = subprocess.run([str(bin_dir / "python"), "-c", probe], cwd=elsewhere, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    package, assets, kernels = out.stdout.split()
    installed = str(env_dir)
    assert package.startswith(installed) and assets.startswith(installed) and kernels.startswith(installed)
