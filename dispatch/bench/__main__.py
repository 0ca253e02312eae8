import sys

from dispatch.bench import main

sys.exit(main())
