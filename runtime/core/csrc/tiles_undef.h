/* The T_* tile macros an instantiation of gemm_tiles.c or gemv_tiles.c defines, undefined after it
 * (gemm_amx.c, gemv_amx.c) */
#undef T_FN
#undef T_DECL
#undef T_CONFIG
#undef T_RELEASE
#undef T_ZERO
#undef T_LOAD
#undef T_STORE
#undef T_DPBF16PS
#undef T_DPBUSD
#undef T_DEQUANT
#undef T_PACK
#undef T_STORE_OUT
#undef T_STAGE
#undef T_EPI
#undef T_OUT
