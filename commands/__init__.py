"""The programs' command-line edges: flags, checks of user input, requests and batch files, printing;
the method modules import none of it."""
