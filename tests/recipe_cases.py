"""What the recipe and launcher tests share: composing and validating a recipe as a user would."""
import pytest

from uccl_ep_train.launchers.recipes import compose
from uccl_ep_train.launchers.validation import validate

# Mandatory fields a Slurm cluster recipe leaves unset (???): tests fill them as a user would.
SLURM_FILL = ["cluster.account=acct", "cluster.container.image=registry/uccl:latest"]


@pytest.fixture
def recipe():
    def make(*overrides, environ=None):
        cfg = compose(list(overrides))
        return cfg, validate(cfg, environ)

    return make
