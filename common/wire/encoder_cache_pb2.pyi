from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    D_TYPE_UNSPECIFIED: _ClassVar[DType]
    D_TYPE_BFLOAT16: _ClassVar[DType]
    D_TYPE_FLOAT16: _ClassVar[DType]
    D_TYPE_FLOAT32: _ClassVar[DType]

class MemoryType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_TYPE_UNSPECIFIED: _ClassVar[MemoryType]
    MEMORY_TYPE_DRAM: _ClassVar[MemoryType]
    MEMORY_TYPE_VRAM: _ClassVar[MemoryType]

class CacheResult(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_RESULT_UNSPECIFIED: _ClassVar[CacheResult]
    CACHE_RESULT_HIT: _ClassVar[CacheResult]
    CACHE_RESULT_MISS: _ClassVar[CacheResult]
D_TYPE_UNSPECIFIED: DType
D_TYPE_BFLOAT16: DType
D_TYPE_FLOAT16: DType
D_TYPE_FLOAT32: DType
MEMORY_TYPE_UNSPECIFIED: MemoryType
MEMORY_TYPE_DRAM: MemoryType
MEMORY_TYPE_VRAM: MemoryType
CACHE_RESULT_UNSPECIFIED: CacheResult
CACHE_RESULT_HIT: CacheResult
CACHE_RESULT_MISS: CacheResult

class CacheLayout(_message.Message):
    __slots__ = ("num_blocks", "block_size", "fat_dim", "dtype", "scratch_block_id", "bytes_per_block", "out_hidden_size", "num_deepstack_levels")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    FAT_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SCRATCH_BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    OUT_HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_DEEPSTACK_LEVELS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_size: int
    fat_dim: int
    dtype: DType
    scratch_block_id: int
    bytes_per_block: int
    out_hidden_size: int
    num_deepstack_levels: int
    def __init__(self, num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., fat_dim: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., scratch_block_id: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., out_hidden_size: _Optional[int] = ..., num_deepstack_levels: _Optional[int] = ...) -> None: ...

class MemoryRegion(_message.Message):
    __slots__ = ("base_address", "stride_bytes", "count", "device_id", "memory_type")
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TYPE_FIELD_NUMBER: _ClassVar[int]
    base_address: int
    stride_bytes: int
    count: int
    device_id: int
    memory_type: MemoryType
    def __init__(self, base_address: _Optional[int] = ..., stride_bytes: _Optional[int] = ..., count: _Optional[int] = ..., device_id: _Optional[int] = ..., memory_type: _Optional[_Union[MemoryType, str]] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("protocol_version", "model_id", "consumer_id", "expected_layout")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    model_id: str
    consumer_id: str
    expected_layout: CacheLayout
    def __init__(self, protocol_version: _Optional[int] = ..., model_id: _Optional[str] = ..., consumer_id: _Optional[str] = ..., expected_layout: _Optional[_Union[CacheLayout, _Mapping]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("protocol_version", "model_id", "incarnation_id", "agent_name", "agent_metadata", "layout", "buffer_region", "min_hold_ms", "lease_ttl_ms", "compatibility_hash", "transport", "preprocess", "stamp_region", "weights_digest", "encoder_id", "tower", "keys_cache_salt")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BUFFER_REGION_FIELD_NUMBER: _ClassVar[int]
    MIN_HOLD_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_HASH_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PREPROCESS_FIELD_NUMBER: _ClassVar[int]
    STAMP_REGION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ENCODER_ID_FIELD_NUMBER: _ClassVar[int]
    TOWER_FIELD_NUMBER: _ClassVar[int]
    KEYS_CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    model_id: str
    incarnation_id: str
    agent_name: str
    agent_metadata: bytes
    layout: CacheLayout
    buffer_region: MemoryRegion
    min_hold_ms: int
    lease_ttl_ms: int
    compatibility_hash: str
    transport: str
    preprocess: PreprocessParams
    stamp_region: MemoryRegion
    weights_digest: str
    encoder_id: str
    tower: str
    keys_cache_salt: bool
    def __init__(self, protocol_version: _Optional[int] = ..., model_id: _Optional[str] = ..., incarnation_id: _Optional[str] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., layout: _Optional[_Union[CacheLayout, _Mapping]] = ..., buffer_region: _Optional[_Union[MemoryRegion, _Mapping]] = ..., min_hold_ms: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ..., compatibility_hash: _Optional[str] = ..., transport: _Optional[str] = ..., preprocess: _Optional[_Union[PreprocessParams, _Mapping]] = ..., stamp_region: _Optional[_Union[MemoryRegion, _Mapping]] = ..., weights_digest: _Optional[str] = ..., encoder_id: _Optional[str] = ..., tower: _Optional[str] = ..., keys_cache_salt: _Optional[bool] = ...) -> None: ...

class PreprocessParams(_message.Message):
    __slots__ = ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels", "fingerprint", "video_min_pixels", "video_max_pixels", "video_sample_fps")
    PATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MERGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    TEMPORAL_PATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MIN_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VIDEO_MIN_PIXELS_FIELD_NUMBER: _ClassVar[int]
    VIDEO_MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    VIDEO_SAMPLE_FPS_FIELD_NUMBER: _ClassVar[int]
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    fingerprint: str
    video_min_pixels: int
    video_max_pixels: int
    video_sample_fps: float
    def __init__(self, patch_size: _Optional[int] = ..., merge_size: _Optional[int] = ..., temporal_patch_size: _Optional[int] = ..., min_pixels: _Optional[int] = ..., max_pixels: _Optional[int] = ..., fingerprint: _Optional[str] = ..., video_min_pixels: _Optional[int] = ..., video_max_pixels: _Optional[int] = ..., video_sample_fps: _Optional[float] = ...) -> None: ...

class VideoFrames(_message.Message):
    __slots__ = ("frames", "fps")
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedScalarFieldContainer[bytes]
    fps: float
    def __init__(self, frames: _Optional[_Iterable[bytes]] = ..., fps: _Optional[float] = ...) -> None: ...

class MediaItem(_message.Message):
    __slots__ = ("image", "video", "uuid", "cache_salt")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    image: bytes
    video: VideoFrames
    uuid: str
    cache_salt: str
    def __init__(self, image: _Optional[bytes] = ..., video: _Optional[_Union[VideoFrames, _Mapping]] = ..., uuid: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class ItemLocation(_message.Message):
    __slots__ = ("mm_hash", "block_ids", "tokens_per_block", "num_tokens", "fingerprint", "generation", "lease_id", "lease_expiry_unix_ms", "result", "grid_thw", "placeholder", "modality")
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRY_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    PLACEHOLDER_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    mm_hash: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    tokens_per_block: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    fingerprint: int
    generation: int
    lease_id: int
    lease_expiry_unix_ms: int
    result: CacheResult
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    placeholder: _containers.RepeatedCompositeFieldContainer[PlaceholderField]
    modality: str
    def __init__(self, mm_hash: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., tokens_per_block: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., fingerprint: _Optional[int] = ..., generation: _Optional[int] = ..., lease_id: _Optional[int] = ..., lease_expiry_unix_ms: _Optional[int] = ..., result: _Optional[_Union[CacheResult, str]] = ..., grid_thw: _Optional[_Iterable[int]] = ..., placeholder: _Optional[_Iterable[_Union[PlaceholderField, _Mapping]]] = ..., modality: _Optional[str] = ...) -> None: ...

class PlaceholderField(_message.Message):
    __slots__ = ("name", "shape", "ints", "floats")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    INTS_FIELD_NUMBER: _ClassVar[int]
    FLOATS_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    ints: IntValues
    floats: FloatValues
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., ints: _Optional[_Union[IntValues, _Mapping]] = ..., floats: _Optional[_Union[FloatValues, _Mapping]] = ...) -> None: ...

class IntValues(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, values: _Optional[_Iterable[int]] = ...) -> None: ...

class FloatValues(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class ItemError(_message.Message):
    __slots__ = ("code", "message", "mm_hash")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    mm_hash: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., mm_hash: _Optional[str] = ...) -> None: ...

class ItemResult(_message.Message):
    __slots__ = ("uuid", "location", "error")
    UUID_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    location: ItemLocation
    error: ItemError
    def __init__(self, uuid: _Optional[str] = ..., location: _Optional[_Union[ItemLocation, _Mapping]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("model_id", "consumer_id", "items", "incarnation_id", "call_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    consumer_id: str
    items: _containers.RepeatedCompositeFieldContainer[MediaItem]
    incarnation_id: str
    call_id: str
    def __init__(self, model_id: _Optional[str] = ..., consumer_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[MediaItem, _Mapping]]] = ..., incarnation_id: _Optional[str] = ..., call_id: _Optional[str] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("results", "incarnation_id")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ItemResult]
    incarnation_id: str
    def __init__(self, results: _Optional[_Iterable[_Union[ItemResult, _Mapping]]] = ..., incarnation_id: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("model_id", "consumer_id", "mm_hashes", "incarnation_id", "call_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    MM_HASHES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    consumer_id: str
    mm_hashes: _containers.RepeatedScalarFieldContainer[str]
    incarnation_id: str
    call_id: str
    def __init__(self, model_id: _Optional[str] = ..., consumer_id: _Optional[str] = ..., mm_hashes: _Optional[_Iterable[str]] = ..., incarnation_id: _Optional[str] = ..., call_id: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("results", "incarnation_id")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ItemResult]
    incarnation_id: str
    def __init__(self, results: _Optional[_Iterable[_Union[ItemResult, _Mapping]]] = ..., incarnation_id: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("consumer_id", "lease_ids", "call_ids")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    CALL_IDS_FIELD_NUMBER: _ClassVar[int]
    consumer_id: str
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    call_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, consumer_id: _Optional[str] = ..., lease_ids: _Optional[_Iterable[int]] = ..., call_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...
