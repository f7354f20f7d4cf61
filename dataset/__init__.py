from dataset.faces import FolderFaceDataset, MXFaceDataset, SyntheticFaceDataset, build_dataset, normalize_batch
from dataset.loader import ResumableDistributedSampler, get_dataloader
from dataset.recordio import IndexedRecordReader, IRHeader, RecordIOError, RecordWriter, pack, unpack

__all__ = ["MXFaceDataset", "normalize_batch", "FolderFaceDataset", "SyntheticFaceDataset", "build_dataset",
           "ResumableDistributedSampler", "get_dataloader", "IndexedRecordReader", "RecordWriter",
           "RecordIOError", "IRHeader", "pack", "unpack"]
