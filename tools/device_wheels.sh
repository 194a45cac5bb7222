#!/usr/bin/env bash
# Download into .whl/ the cp312 x86_64 wheels the device image lacks, for tools/gpu_session.sh (which
# installs every carried .whl/*.whl into /tmp/site): fla-core (GPU prefill), llguidance (structured
# outputs) and `ninfer serve`'s stack. Versions are the CPU venv's, so the device runs what the tests ran.
# Not carried, because the image has them (KINDS.md's package list) within the ranges these need: anyio,
# h11, click, idna, uvloop, prometheus-client, annotated-doc, einops. typing-extensions is carried although
# the image has one: pydantic 2.14 needs >= 4.16, newer than the image may hold. Run from the repo root;
# `.whl/` must be ignored (echo /.whl/ >> .git/info/exclude). Prints the total size (a call carries <= 64 MiB).
set -euo pipefail
DEST=${1:-.whl}
WHEELS=(
  fla-core==0.6.0
  llguidance==1.9.1
  fastapi==0.165.0
  starlette==1.10.0
  opentelemetry-api==1.45.2
  uvicorn==0.55.0
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  orjson==3.13.0
)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform manylinux_2_31_x86_64)
mkdir -p "$DEST"
for spec in "${WHEELS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$DEST" "$spec"
done
# one version of each package, or the device's install stops: refuse leftovers of other versions
dupes=$(ls "$DEST"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [ -n "$dupes" ]; then
  echo "device_wheels: $DEST holds several versions of: $dupes; remove the old ones" >&2
  exit 1
fi
ls -l "$DEST"/*.whl | awk '{print $5, $NF}'
du -cb "$DEST"/*.whl | tail -n1 | awk '{printf "total %.1f MiB\n", $1 / 1048576}'
