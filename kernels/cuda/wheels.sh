#!/usr/bin/env bash
# The wheels the GPU machine's image lacks (it has torch, numpy, pandas, pillow, scipy, httpx, huggingface-hub, typer,
# ...: IMAGE below), for CPython 3.12 on manylinux x86_64, at requirements.txt's pins and, for their dependencies, the
# versions this project's page runs with. Two folders, because together with the repository (~8 MB) and .gpu/
# (~12 MB) they pass the 64 MiB one device call carries:
#   .whl/       the models' side, for the measurement calls and the page: transformers, tokenizers, gguf, soundfile
#   .whl-page/  the page: gradio and its server stack, gradio_client, plotly
# Both folders are ignored (.git/info/exclude). On the GPU machine, after a call that carried .whl/ (and .gpu/):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
# and in the page's call (carry .whl-page; a warm machine keeps /tmp/site and /tmp/models from the earlier call):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-page/*.whl
#   export PYTHONPATH=/tmp/site; bash kernels/cuda/wheels.sh check
#
#   bash kernels/cuda/wheels.sh [download]   fill both folders here (pip download from the index), then `deps`
#   bash kernels/cuda/wheels.sh deps         every shipped wheel's Requires-Dist: shipped, assumed in the image, or missing
#   bash kernels/cuda/wheels.sh check [DIR]  on the GPU machine: what DIR (/tmp/site) installed has its requirements met
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root

MODELS=(transformers==5.23.0 tokenizers==0.23.3 gguf==0.19.0 soundfile==0.14.0 cffi==2.0.0 pycparser==3.0)
PAGE=(gradio==6.31.0 gradio-client==2.7.2 hf-gradio==0.4.1 plotly==7.1.0 narwhals==2.29.0
      fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 opentelemetry-api==1.45.2 annotated-doc==0.0.7
      pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
      safehttpx==0.1.7 groovy==0.1.2 orjson==3.13.0 brotli==1.2.1 pydub==0.25.1 python-multipart==0.0.34
      semantic-version==2.10.0 tomlkit==0.14.0 pytz==2026.6)
# In the image (the task's list; scipy because the CLI, which imports it, runs there without a wheel of it).
IMAGE="torch numpy pandas pillow httpx anyio jinja2 pyyaml huggingface-hub aiofiles uvloop rich typer click
       cupy-cuda13x scipy fsspec filelock requests urllib3 idna certifi charset-normalizer typing-extensions packaging
       tqdm regex safetensors markupsafe pygments markdown-it-py mdurl shellingham python-dateutil six tzdata sniffio
       h11 httpcore websockets hf-xet"

PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)

download() {  # download FOLDER SPEC...: each pinned wheel once; wheels of other versions or names are removed
  local folder=$1; shift
  mkdir -p "$folder"
  local spec
  for spec in "$@"; do
    if ! python3 - "$folder" "$spec" <<'EOF'
import re, sys
from pathlib import Path
folder, spec = sys.argv[1], sys.argv[2]
name, version = spec.split("==")
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
sys.exit(0 if any(norm(w.name.split("-")[0]) == norm(name) and w.name.split("-")[1] == version
                  for w in Path(folder).glob("*.whl")) else 1)
EOF
    then
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$folder" "$spec" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
    fi
  done
  python3 - "$folder" "$@" <<'EOF'
import re, sys
from pathlib import Path
folder, specs = Path(sys.argv[1]), sys.argv[2:]
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
wanted = {(norm(s.split("==")[0]), s.split("==")[1]) for s in specs}
have = {}
for w in folder.glob("*.whl"):
    key = (norm(w.name.split("-")[0]), w.name.split("-")[1])
    if key not in wanted:
        print(f"removing {w.name} (not pinned here)")
        w.unlink()
    else:
        have[key] = w
missing = sorted(f"{n}=={v}" for n, v in wanted - set(have))
if missing:
    sys.exit(f"{folder}: no wheel for {', '.join(missing)}")
EOF
}

deps() {  # every shipped wheel's requirements (Python 3.12, Linux x86_64, no extras) against shipped + IMAGE
  python3 - "$IMAGE" .whl .whl-page <<'EOF'
import re, sys, zipfile
from email.parser import Parser
from pathlib import Path
from packaging.requirements import Requirement
from packaging.version import Version

image = set(sys.argv[1].split())
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "os_name": "posix",
       "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "extra": ""}
shipped, metas = {}, []
for folder in sys.argv[2:]:
    total = 0
    for wheel in sorted(Path(folder).glob("*.whl")):
        total += wheel.stat().st_size
        with zipfile.ZipFile(wheel) as z:
            meta = Parser().parsestr(z.read(next(n for n in z.namelist()
                                                 if n.endswith(".dist-info/METADATA"))).decode())
        shipped[norm(meta["Name"])] = Version(meta["Version"])
        metas.append((folder, meta))
    print(f"{folder}: {len(list(Path(folder).glob('*.whl')))} wheels, {total / 2**20:.1f} MiB")
problems, assumed = [], {}
for folder, meta in metas:
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = norm(req.name)
        if name in shipped:
            if req.specifier and shipped[name] not in req.specifier:
                problems.append(f"{meta['Name']} needs {req}, shipped {shipped[name]}")
        elif name in image:
            assumed.setdefault(name, set()).update(str(req.specifier).split(",") if req.specifier else ())
        else:
            problems.append(f"{meta['Name']} needs {req}: neither shipped nor in the image list")
print("assumed in the image:", ", ".join(name + ",".join(sorted(specs)) for name, specs in sorted(assumed.items())))
print("\n".join(problems) if problems else "every requirement is shipped or assumed in the image")
sys.exit(1 if problems else 0)
EOF
}

check() {  # on the GPU machine: the requirements of what DIR holds, met by what Python finds (PYTHONPATH first)
  python3 - "${1:-/tmp/site}" <<'EOF'
import importlib.metadata as md, sys
from packaging.requirements import Requirement
site = sys.argv[1]
if site not in sys.path:
    sys.exit(f"{site} is not on sys.path: export PYTHONPATH={site}")
problems, count = [], 0
for dist in md.distributions(path=[site]):
    count += 1
    found = md.version(dist.metadata["Name"])
    if found != dist.version:
        problems.append(f"{dist.metadata['Name']}: {site} holds {dist.version} but Python finds {found}")
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            problems.append(f"{dist.metadata['Name']} needs {req}: not installed")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            problems.append(f"{dist.metadata['Name']} needs {req}: found {have}")
print(f"{count} distributions in {site}")
print("\n".join(problems) if problems else "every requirement is met")
sys.exit(1 if problems else 0)
EOF
}

case "${1:-download}" in
download)
  download .whl "${MODELS[@]}"
  download .whl-page "${PAGE[@]}"
  deps
  du -sh .whl .whl-page
  ;;
deps) deps ;;
check) check "${2:-/tmp/site}" ;;
*) echo "usage: $0 [download|deps|check [DIR]]" >&2; exit 2 ;;
esac
