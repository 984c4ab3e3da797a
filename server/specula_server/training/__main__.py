from specula_server.training.cli import app

app(prog_name="specula-train")
