"""Using a trained face model: load any form of one, find faces, embed, compare, identify. Its
public names are `shardface`'s (`from shardface import load_model, Gallery`)."""
