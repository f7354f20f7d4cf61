from shardface.dataset.errors import (
    DataError,
    DataLayoutError,
    ImageDecodeError,
    ImageSizeError,
    LabelError,
    RecordIOError,
)
from shardface.dataset.faces import FolderFaceDataset, MXFaceDataset, SyntheticDataset, build_dataset
from shardface.dataset.folders import list_identity_folders
from shardface.dataset.images import decode_chw, decode_image, normalize_images
from shardface.dataset.loader import ResumableDistributedSampler, get_dataloader
from shardface.dataset.recordio import IndexedRecordReader, IRHeader, RecordWriter, pack, unpack

__all__ = [
    "MXFaceDataset",
    "FolderFaceDataset",
    "SyntheticDataset",
    "build_dataset",
    "list_identity_folders",
    "normalize_images",
    "decode_image",
    "decode_chw",
    "ResumableDistributedSampler",
    "get_dataloader",
    "IndexedRecordReader",
    "RecordWriter",
    "IRHeader",
    "pack",
    "unpack",
    "DataError",
    "RecordIOError",
    "ImageDecodeError",
    "LabelError",
    "DataLayoutError",
    "ImageSizeError",
]
