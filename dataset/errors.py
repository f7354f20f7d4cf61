"""What can be wrong with training data. Every message names the file and the key or value."""

from shardface.errors import DataError


class RecordIOError(DataError):
    """A .rec/.idx structure problem, with the file and the key or offset that is wrong."""


class ImageDecodeError(DataError):
    """An image whose bytes cannot be decoded (`skip_bad_images` skips exactly these)."""


class LabelError(DataError):
    """A label outside [0, num_classes)."""


class DataLayoutError(DataError):
    """A data directory, image folder or `property` file that is missing or does not match the config."""


class ImageSizeError(DataError):
    """Images that are not the size the backbones take (112x112), found before training or packing."""
