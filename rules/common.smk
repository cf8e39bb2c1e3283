# Shared set-up: params validated on load, keys and keyed paths from eaglet itself.
import os
import re
import sys

from snakemake.utils import min_version

from eaglet.errors import EagletError
from eaglet.keys import Keys
from eaglet.params import load

min_version("9.0")

PARAMS_FILE = config.get("params", "params.yaml")
try:
    PARAMS = load(PARAMS_FILE)
    KEYS = Keys(PARAMS)
except EagletError as e:
    sys.exit(f"eaglet: error: {e}")
DATASETS = PARAMS.datasets
EAGLET = f"{sys.executable} -m eaglet"


wildcard_constraints:
    dataset="|".join(re.escape(d) for d in DATASETS),
    key="[0-9a-f]{12}",


def keyed(stage, name=None):
    """The current keyed path of an artifact, relative to the working directory."""
    try:
        path = KEYS.path(stage, name)
    except EagletError as e:
        sys.exit(f"eaglet: error: {e}")
    return os.path.relpath(path)


def upstream(stage):
    """Input function: the dataset's current `stage` artifact. Keyed, so never stale by mtime."""
    return lambda wc: ancient(keyed(stage, wc.dataset))


def remote_backend(dataset):
    """Whether the dataset's backend is a server (sglang, openai) rather than in-process."""
    return PARAMS.backend(PARAMS.generation(dataset)["backend"])["kind"] != "transformers"
