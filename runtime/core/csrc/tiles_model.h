/* The T_* tile macros over the portable tile model (tile_model.c): an instantiation of gemm_tiles.c
 * or gemv_tiles.c includes this, defines its staging macros, includes the kernel, then
 * tiles_undef.h */
#define T_FN(name) name##_model
#define T_DECL sq_tiles tm_own_, *tm = &tm_own_
#define T_CONFIG(cfg) tm_loadconfig(tm, cfg)
#define T_RELEASE() ((void)tm)
#define T_ZERO(i) tm_zero(tm, i)
#define T_LOAD(i, p, s) tm_load(tm, i, p, s)
#define T_STORE(i, p, s) tm_store(tm, i, p, s)
#define T_DPBF16PS(c, a, b) tm_dpbf16ps(tm, c, a, b)
#define T_DPBUSD(c, a, b) tm_dpbusd(tm, c, a, b)
