"""Faces in photos: detection, five landmarks, and alignment onto a network's crop template."""
