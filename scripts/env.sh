# Sourced by the launch scripts: `$python` is the repository's .venv/bin/python when there is
# one (no need to activate it), else $PYTHON or python on PATH; the repository root is on
# PYTHONPATH, so the scripts run from any directory.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -n ${PYTHON:-} ]]; then python=$PYTHON
elif [[ -x $root/.venv/bin/python ]]; then python=$root/.venv/bin/python
else python=python; fi
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
