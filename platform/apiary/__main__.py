from apiary.cli.main import app

app()
