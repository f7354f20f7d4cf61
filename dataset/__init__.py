"""Training data: RecordIO and image folders, their loaders, and what can be wrong with them. The
names below load on first use, so `shardface.dataset.errors` or `.images` import without torch."""

from shardface.lazy import lazy_exports

_PUBLIC = {
    "DataError": "shardface.dataset.errors",
    "DataLayoutError": "shardface.dataset.errors",
    "ImageDecodeError": "shardface.dataset.errors",
    "ImageSizeError": "shardface.dataset.errors",
    "LabelError": "shardface.dataset.errors",
    "RecordIOError": "shardface.dataset.errors",
    "FolderFaceDataset": "shardface.dataset.faces",
    "MXFaceDataset": "shardface.dataset.faces",
    "SyntheticDataset": "shardface.dataset.faces",
    "build_dataset": "shardface.dataset.faces",
    "list_identity_folders": "shardface.dataset.folders",
    "decode_chw": "shardface.dataset.images",
    "decode_image": "shardface.dataset.images",
    "normalize_images": "shardface.dataset.images",
    "ResumableDistributedSampler": "shardface.dataset.loader",
    "get_dataloader": "shardface.dataset.loader",
    "IndexedRecordReader": "shardface.dataset.recordio",
    "IRHeader": "shardface.dataset.recordio",
    "RecordWriter": "shardface.dataset.recordio",
    "pack": "shardface.dataset.recordio",
    "unpack": "shardface.dataset.recordio",
}
__all__ = list(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
