"""Does dynamic sampling pay at equal generated tokens? Its pre-registered sweep and its results page."""
