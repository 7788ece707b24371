"""The command line: the only package of kvpage that imports typer or rich.

`app.py` holds the Typer app and its `main()`, `script.py` the console script around it (the
imports with the collector paused); one module per command (`review`,
`ask`, `info`); `options.py` the options the commands share; `session.py` one run (errors,
reading input, loading the model, statistics); `output.py` the data sink; `progress.py` engine
events as progress bars on stderr; `render.py` results as table, markdown, text and JSON;
`server.py` the server `kvpage serve` starts and the hand-over every command tries first
(standard library only, before anything else is imported).
"""
