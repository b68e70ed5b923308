from spmd_rfdetr.cli import main

main()
