import sys

from uccl_ep_train.cli import main

sys.exit(main())
