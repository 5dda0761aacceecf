from workers.node.agent import main

main()
