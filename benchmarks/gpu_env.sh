# Source on the device machine: makes the working tree importable as `alignzoo`
# without installing (the device has no network for pip).
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/alignzoo && export PYTHONPATH=/tmp/pkg${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
