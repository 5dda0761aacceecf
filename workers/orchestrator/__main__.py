from workers.orchestrator.worker import main

main()
