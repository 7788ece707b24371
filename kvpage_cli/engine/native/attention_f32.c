/* Decode attention's per-item functions for f32 blocks (attention_item.h says why they are
 * a file of their own). */
#include "attention_item.h"

ITEM_FNS(KIND_F32, f32)
