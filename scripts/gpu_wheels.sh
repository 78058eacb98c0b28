#!/usr/bin/env bash
# The wheels scripts/gpu_check.sh needs on a GPU machine whose image lacks them (the lent
# H100/H200: Python 3.12, torch, pytest, psutil, cloudpickle, numpy there; no IPython,
# Jupyter, widgets or cryptography), at the versions this checkout's .venv holds, into
# .whl/ (ignored by git: .git/info/exclude). Run here, where pip reaches PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
NAMES="ipython ipython_pygments_lexers ipykernel ipywidgets widgetsnbextension jupyterlab_widgets
anywidget psygnal cryptography cffi pycparser jupyter_client jupyter_core pyzmq tornado traitlets
comm debugpy nest_asyncio matplotlib-inline decorator jedi parso pexpect ptyprocess
prompt_toolkit wcwidth stack_data executing asttokens pure_eval platformdirs"
for name in $NAMES; do
    version=$(.venv/bin/python -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
    [ -n "$version" ] || { echo "gpu_wheels: $name is not in .venv: skipped"; continue; }
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d .whl "$name==$version"
done
du -sh .whl
