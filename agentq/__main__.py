from agentq.cli.main import main

raise SystemExit(main())
