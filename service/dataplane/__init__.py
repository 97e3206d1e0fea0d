"""Protocol types and the one dataplane every transport calls."""
from .dataplane import EXTENSIONS, DataPlane
from .signature import ModelSignature, TensorSpec
from .types import DATATYPES, InferRequest, InferResponse, InferTensor, RequestedOutput, datatype_of, numpy_dtype

__all__ = ["DataPlane", "EXTENSIONS", "ModelSignature", "TensorSpec", "DATATYPES", "InferRequest", "InferResponse",
           "InferTensor", "RequestedOutput", "datatype_of", "numpy_dtype"]
