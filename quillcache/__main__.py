from quillcache.cli import main

raise SystemExit(main())
