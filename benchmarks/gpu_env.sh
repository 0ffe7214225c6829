# Source on the device machine: makes the working tree importable as `alignzoo`
# without installing (the device has no network for pip).  Each tree gets its
# own link directory (keyed by its path), so sourcing this in a second tree
# (a side-by-side run of two commits) cannot re-point the first tree's import.
_AZ_PKG=/tmp/pkg/$(printf %s "$PWD" | md5sum | cut -c1-12)
mkdir -p "$_AZ_PKG" && ln -sfn "$PWD" "$_AZ_PKG/alignzoo" && export PYTHONPATH=$_AZ_PKG${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
