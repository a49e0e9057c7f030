from moepack.cli.main import main

main()
