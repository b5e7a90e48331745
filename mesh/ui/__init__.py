"""The web page of the mesh (mesh/api/ui.py serves it): package data, no build step."""
