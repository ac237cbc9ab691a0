"""The load path: pick a committed checkpoint, check it fits, load it resharded through DCP."""
