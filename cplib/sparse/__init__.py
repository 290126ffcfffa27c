"""cplib.sparse: sparse (indexed) attention under context parallelism, in
torch alone (no model library): which keys a query may see and which it
attends (selection), the rows of a sharded sequence moved to the ranks that
read them, by gather or fetch, whichever moves fewer bytes (rows), and
attention over the selected keys with a memory-light backward (attention).
DeepSeek Sparse Attention models of transformers reach it through
cplib/integrations/transformers/sparse/; see docs/sparse.md."""

from .attention import masked_attention
from .rows import RowLayout, RowsPlan, all_rows, plan_rows, take_rows
from .selection import attended, query_block, visible

__all__ = ["masked_attention", "RowLayout", "RowsPlan", "all_rows", "plan_rows", "take_rows",
           "attended", "query_block", "visible"]
