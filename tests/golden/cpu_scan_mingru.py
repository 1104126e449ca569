# from tvm.script import ir as I
# from tvm.script import tirx as T
# from tvm.tirx.layout import Axis

@I.ir_module
class Module:
    @T.prim_func(s_tir=True)
    def main(x: T.Buffer((160, 8), "float32"), h0: T.Buffer((2, 16), "float32"), weight_ih: T.Buffer((32, 8), "float32"), bias_ih: T.Buffer((32,), "float32"), h_seq: T.Buffer((162, 16), "float32")):
        T.func_attr({"tirx.noalias": True})
        # with T.sblock("root"):
        x_proj0 = T.alloc_buffer((160, 32))
        with T.sblock("prologue"):
            T.reads(weight_ih[0:32, 0:8], x[0:160, 0:8])
            T.writes(x_proj0[0:160, 0:32])
            w_packed0 = T.sblock_alloc_buffer((2, 8, 16))
            x_proj0_local = T.sblock_alloc_buffer((160, 32), scope="local")
            for i0 in T.parallel(2):
                for i1, i2_0 in T.grid(8, 2):
                    for i2_1 in T.vectorized(8):
                        with T.sblock("w_packed0"):
                            v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                            v_i2 = T.axis.spatial(16, i2_0 * 8 + i2_1)
                            T.reads(weight_ih[v_i0 * 16 + v_i2, v_i1])
                            T.writes(w_packed0[v_i0, v_i1, v_i2])
                            w_packed0[v_i0, v_i1, v_i2] = T.if_then_else(v_i0 * 16 + v_i2 < 32, weight_ih[v_i0 * 16 + v_i2, v_i1], T.float32(0.0))
            for b_0_n_0_b_1_fused in T.parallel(96):
                for b_2_init in T.unroll(4):
                    for n_1_init in T.vectorized(16):
                        with T.sblock("x_proj0_init"):
                            v_b = T.axis.spatial(160, b_0_n_0_b_1_fused // 32 * 64 + b_0_n_0_b_1_fused % 16 * 4 + b_2_init)
                            v_n = T.axis.spatial(32, b_0_n_0_b_1_fused % 32 // 16 * 16 + n_1_init)
                            T.where((b_0_n_0_b_1_fused // 32 * 16 + b_0_n_0_b_1_fused % 16) * 4 + b_2_init < 160)
                            T.reads()
                            T.writes(x_proj0_local[v_b, v_n])
                            x_proj0_local[v_b, v_n] = T.float32(0.0)
                for k in range(8):
                    for b_2 in T.unroll(4):
                        for n_1 in T.vectorized(16):
                            with T.sblock("x_proj0_update"):
                                v_b = T.axis.spatial(160, b_0_n_0_b_1_fused // 32 * 64 + b_0_n_0_b_1_fused % 16 * 4 + b_2)
                                v_n = T.axis.spatial(32, b_0_n_0_b_1_fused % 32 // 16 * 16 + n_1)
                                v_k = T.axis.reduce(8, k)
                                T.where((b_0_n_0_b_1_fused // 32 * 16 + b_0_n_0_b_1_fused % 16) * 4 + b_2 < 160)
                                T.reads(x_proj0_local[v_b, v_n], x[v_b, v_k], w_packed0[v_n // 16, v_k, v_n % 16])
                                T.writes(x_proj0_local[v_b, v_n])
                                x_proj0_local[v_b, v_n] = x_proj0_local[v_b, v_n] + x[v_b, v_k] * w_packed0[v_n // 16, v_k, v_n % 16]
                for ax0 in range(4):
                    for ax1 in T.vectorized(16):
                        with T.sblock("x_proj0_local"):
                            v0 = T.axis.spatial(160, (b_0_n_0_b_1_fused // 32 * 16 + b_0_n_0_b_1_fused % 16) * 4 + ax0)
                            v1 = T.axis.spatial(32, b_0_n_0_b_1_fused % 32 // 16 * 16 + ax1)
                            T.where(b_0_n_0_b_1_fused // 32 * 16 + b_0_n_0_b_1_fused % 16 < 40)
                            T.reads(x_proj0_local[v0, v1])
                            T.writes(x_proj0[v0, v1])
                            x_proj0[v0, v1] = x_proj0_local[v0, v1]
        with T.sblock("scan"):
            T.reads(x_proj0[0:160, 0:32], bias_ih[0:32], h0[0:2, 0:16])
            T.writes(h_seq[0:259, 0:16])
            h_prod = T.sblock_alloc_buffer((4, 16), "float64")
            h_part = T.sblock_alloc_buffer((4, 16), "float64")
            h_carry = T.sblock_alloc_buffer((4, 16), "float64")
            x_proj0_t = T.match_buffer(x_proj0[0:160, 0:32], (160, 32), offset_factor=1)
            for c_r_j_fused in T.parallel(4):
                with T.sblock("chunk_h"):
                    vc = T.axis.spatial(2, c_r_j_fused // 2)
                    vr = T.axis.spatial(2, c_r_j_fused % 2)
                    vj = T.axis.spatial(1, 0)
                    prod = T.Buffer((16,), "float64", scope="local")
                    acc = T.Buffer((16,), "float64", scope="local")
                    T.reads(prod[0:16], x_proj0_t[vc * 128 + vr:vc * 128 + vr + (T.min(64, 80 - vc * 64) * 2 - 1), vj * 16:vj * 16 + 32], bias_ih[vj * 16:vj * 16 + 32], acc[0:16])
                    T.writes(prod[0:16], acc[0:16], h_prod[vc * 2 + vr, vj * 16:vj * 16 + 16], h_part[vc * 2 + vr, vj * 16:vj * 16 + 16])
                    prod = T.sblock_alloc_buffer((16,), "float64", scope="local")
                    acc = T.sblock_alloc_buffer((16,), "float64", scope="local")
                    for v in range(2):
                        for l in T.vectorized(8):
                            prod[v * 8 + l] = T.float64(1.0)
                            acc[v * 8 + l] = T.float64(0.0)
                    for t, v in T.grid(T.min(64, 80 - vc * 64), 2):
                        for l in T.vectorized(8):
                            prod[v * 8 + l] = prod[v * 8 + l] * T.Cast("float64", T.float32(1.0) - T.sigmoid(x_proj0_t[(vc * 64 + t) * 2 + vr, vj * 16 + v * 8 + l] + bias_ih[vj * 16 + v * 8 + l]))
                            acc[v * 8 + l] = T.Cast("float64", T.float32(1.0) - T.sigmoid(x_proj0_t[(vc * 64 + t) * 2 + vr, vj * 16 + v * 8 + l] + bias_ih[vj * 16 + v * 8 + l])) * acc[v * 8 + l] + T.Cast("float64", T.sigmoid(x_proj0_t[(vc * 64 + t) * 2 + vr, vj * 16 + v * 8 + l] + bias_ih[vj * 16 + v * 8 + l]) * (x_proj0_t[(vc * 64 + t) * 2 + vr, vj * 16 + v * 8 + l + 16] + bias_ih[vj * 16 + v * 8 + l + 16]))
                    for v in range(2):
                        for l in T.vectorized(8):
                            h_prod[vc * 2 + vr, vj * 16 + v * 8 + l] = prod[v * 8 + l]
                            h_part[vc * 2 + vr, vj * 16 + v * 8 + l] = acc[v * 8 + l]
            for r_j_fused in T.parallel(2):
                with T.sblock("carry_h"):
                    vr = T.axis.spatial(2, r_j_fused)
                    vj = T.axis.spatial(1, 0)
                    T.reads(h0[vr, vj * 16:vj * 16 + 16], h_prod[vr:vr + 4, vj * 16:vj * 16 + 16], h_part[vr:vr + 4, vj * 16:vj * 16 + 16])
                    T.writes(h_seq[vr, vj * 16:vj * 16 + 16], h_carry[vr:vr + 4, vj * 16:vj * 16 + 16])
                    acc = T.sblock_alloc_buffer((16,), "float64", scope="local")
                    for v in range(2):
                        for l in T.vectorized(8):
                            acc[v * 8 + l] = T.Cast("float64", h0[vr, vj * 16 + v * 8 + l])
                            h_seq[vr, vj * 16 + v * 8 + l] = h0[vr, vj * 16 + v * 8 + l]
                    for c, v in T.grid(2, 2):
                        for l in T.vectorized(8):
                            h_carry[c * 2 + vr, vj * 16 + v * 8 + l] = acc[v * 8 + l]
                            acc[v * 8 + l] = h_prod[c * 2 + vr, vj * 16 + v * 8 + l] * acc[v * 8 + l] + h_part[c * 2 + vr, vj * 16 + v * 8 + l]
            for c_r_j_fused in T.parallel(4):
                with T.sblock("apply_h"):
                    vc = T.axis.spatial(2, c_r_j_fused // 2)
                    vr = T.axis.spatial(2, c_r_j_fused % 2)
                    vj = T.axis.spatial(1, 0)
                    acc = T.Buffer((16,), scope="local")
                    T.reads(h_carry[vc * 2 + vr, vj * 16:vj * 16 + 16], x_proj0_t[vc * 128 + vr:vc * 128 + vr + (T.min(64, 80 - vc * 64) * 2 - 1), vj * 16:vj * 16 + 32], bias_ih[vj * 16:vj * 16 + 32], acc[0:16])
                    T.writes(acc[0:16], h_seq[vc * 128 + vr + 2:vc * 128 + vr + 2 + (T.min(64, 80 - vc * 64) * 2 - 1), vj * 16:vj * 16 + 16])
                    acc = T.sblock_alloc_buffer((16,), scope="local")
                    for v in range(2):
                        for l in T.vectorized(8):
                            acc[v * 8 + l] = T.Cast("float32", h_carry[vc * 2 + vr, vj * 16 + v * 8 + l])
                    for t, v in T.grid(T.min(64, 80 - vc * 64), 2):
                        for l in T.vectorized(8):
                            acc[v * 8 + l] = (T.float32(1.0) - T.sigmoid(x_proj0_t[(vc * 64 + t) * 2 + vr, vj * 16 + v * 8 + l] + bias_ih[vj * 16 + v * 8 + l])) * acc[v * 8 + l] + T.sigmoid(x_proj0_t[(vc * 64 + t) * 2 + vr, vj * 16 + v * 8 + l] + bias_ih[vj * 16 + v * 8 + l]) * (x_proj0_t[(vc * 64 + t) * 2 + vr, vj * 16 + v * 8 + l + 16] + bias_ih[vj * 16 + v * 8 + l + 16])
                            h_seq[(vc * 64 + t) * 2 + vr + 2, vj * 16 + v * 8 + l] = T.Cast("float32", acc[v * 8 + l])
