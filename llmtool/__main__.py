from llmtool.cli import main

main()
