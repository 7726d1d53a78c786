"""Claim C5, time to accuracy under real asynchrony: its sweep and page."""
