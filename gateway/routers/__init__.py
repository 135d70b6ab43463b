"""The gateway's HTTP surfaces, one router each; gateway/app.py includes them all."""
