import sys

from fedvlm.attacks.run import main

sys.exit(main())
