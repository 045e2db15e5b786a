#!/bin/bash
# Render a `tracetop report` HTML file in headless Chromium and save a PNG screenshot; fail if the
# PNG is blank (one colour). Needs Debian's `chromium` (apt-get install chromium, ~480 MB; not part
# of `make setup`).
#   scripts/report_screenshot.sh report.html [out.png] [WIDTHxHEIGHT]
set -euo pipefail
html=${1:?usage: scripts/report_screenshot.sh REPORT.html [OUT.png] [WxH]}
png=${2:-${html%.html}.png}
size=${3:-1280x4000}
command -v chromium >/dev/null || { echo "no chromium on PATH: apt-get install chromium" >&2; exit 2; }
[ -f "$html" ] || { echo "$html: no such file" >&2; exit 2; }
abs_html=$(cd "$(dirname "$html")" && pwd)/$(basename "$html")
abs_png=$(cd "$(dirname "$png")" && pwd)/$(basename "$png")
rm -f "$abs_png"
# as root chromium needs --no-sandbox; the page has no script, so no --virtual-time-budget is needed
timeout 120 chromium --headless --no-sandbox --disable-gpu --log-level=3 --hide-scrollbars \
  --screenshot="$abs_png" --window-size="${size/x/,}" "file://$abs_html" >/dev/null 2>&1 || true
[ -s "$abs_png" ] || { echo "chromium wrote no screenshot" >&2; exit 1; }
PY=${PY:-$(dirname "$0")/../.venv/bin/python}
"$PY" - "$abs_png" <<'PYEOF'
import sys
from PIL import Image
im = Image.open(sys.argv[1]).convert("RGB")
colours = im.getcolors(maxcolors=1 << 20)
n = len(colours) if colours is not None else 1 << 20
dark = sum(c for c, rgb in (colours or []) if sum(rgb) < 600)
if n < 16:
    print(f"{sys.argv[1]}: blank screenshot ({n} colours)"); sys.exit(1)
print(f"{sys.argv[1]}: {im.width}x{im.height}, {n} colours, {dark} non-white pixels")
PYEOF
