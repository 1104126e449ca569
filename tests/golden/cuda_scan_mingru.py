# from tvm.script import ir as I
# from tvm.script import tirx as T
# from tvm.tirx.layout import Axis

@I.ir_module
class Module:
    @T.prim_func(s_tir=True)
    def main(x: T.Buffer((80, 8), "float32"), h0: T.Buffer((2, 16), "float32"), weight_ih: T.Buffer((32, 8), "float32"), bias_ih: T.Buffer((32,), "float32"), h_seq: T.Buffer((82, 16), "float32")):
        T.func_attr({"tirx.noalias": True})
        # with T.sblock("root"):
        x_proj0 = T.alloc_buffer((80, 32))
        with T.sblock("prologue"):
            T.reads(weight_ih[0:32, 0:8], x[0:80, 0:8])
            T.writes(x_proj0[0:80, 0:32])
            w_packed0 = T.sblock_alloc_buffer((8, 32))
            x_reindex_shared = T.sblock_alloc_buffer((80, 8), scope="shared")
            w_packed0_reindex_shared = T.sblock_alloc_buffer((8, 32), scope="shared")
            x_proj0_local = T.sblock_alloc_buffer((80, 32), scope="local")
            w_packed0_shared = T.sblock_alloc_buffer((8, 32), scope="shared")
            for i0_0_i1_0_fused in T.thread_binding(1, thread="blockIdx.x"):
                for i1_1 in range(4):
                    for i1_2_i0_1_fused in T.thread_binding(256, thread="threadIdx.x"):
                        with T.sblock("w_packed0"):
                            v_i0 = T.axis.spatial(8, i1_2_i0_1_fused % 32)
                            v_i1 = T.axis.spatial(32, i1_1 * 8 + i1_2_i0_1_fused // 32)
                            T.where(T.Mul(0, 32) + i1_2_i0_1_fused % 32 < 8)
                            T.reads(weight_ih[v_i1, v_i0])
                            T.writes(w_packed0_shared[v_i0, v_i1])
                            T.sblock_attr({"buffer_dim_align": [[0, 0, 32, 1]]})
                            w_packed0_shared[v_i0, v_i1] = T.if_then_else(v_i1 < 32, weight_ih[v_i1, v_i0], T.float32(0.0))
                for ax0_ax1_fused_0 in range(1):
                    for ax0_ax1_fused_1 in T.thread_binding(256, thread="threadIdx.x"):
                        with T.sblock("w_packed0_shared"):
                            v0 = T.axis.spatial(8, (ax0_ax1_fused_0 * 256 + ax0_ax1_fused_1) // 32)
                            v1 = T.axis.spatial(32, (ax0_ax1_fused_0 * 256 + ax0_ax1_fused_1) % 32)
                            T.reads(w_packed0_shared[v0, v1])
                            T.writes(w_packed0[v0, v1])
                            w_packed0[v0, v1] = w_packed0_shared[v0, v1]
            for b_0_n_0_fused in T.thread_binding(1, thread="blockIdx.x"):
                for b_1_n_1_fused in T.thread_binding(256, thread="threadIdx.x"):
                    for b_2_init in T.unroll(8):
                        for n_2_init in T.unroll(8):
                            with T.sblock("x_proj0_init"):
                                v_b = T.axis.spatial(80, b_1_n_1_fused // 16 * 8 + b_2_init)
                                v_n = T.axis.spatial(32, b_1_n_1_fused % 16 * 8 + n_2_init)
                                T.where((T.Mul(0, 16) + b_1_n_1_fused // 16) * 8 + b_2_init < 80 and (T.Mul(0, 16) + b_1_n_1_fused % 16) * 8 + n_2_init < 32)
                                T.reads()
                                T.writes(x_proj0_local[v_b, v_n])
                                x_proj0_local[v_b, v_n] = T.float32(0.0)
                    for k_0 in range(1):
                        for ax0_ax1_fused_0 in range(1):
                            for ax0_ax1_fused_1 in T.thread_binding(256, thread="threadIdx.x"):
                                for ax0_ax1_fused_2 in T.vectorized(4):
                                    with T.sblock("x_reindex_reindex"):
                                        v0 = T.axis.spatial(80, (ax0_ax1_fused_0 * 1024 + ax0_ax1_fused_1 * 4 + ax0_ax1_fused_2) // 8)
                                        v1 = T.axis.spatial(8, (ax0_ax1_fused_0 * 1024 + ax0_ax1_fused_1 * 4 + ax0_ax1_fused_2) % 8)
                                        T.where((ax0_ax1_fused_0 * 256 + ax0_ax1_fused_1) * 4 + ax0_ax1_fused_2 < 640)
                                        T.reads(x[v0, v1])
                                        T.writes(x_reindex_shared[v0, v1])
                                        x_reindex_shared[v0, v1] = x[v0, v1]
                        for ax1_ax0_fused_0 in range(1):
                            for ax1_ax0_fused_1 in T.thread_binding(256, thread="threadIdx.x"):
                                for ax1_ax0_fused_2 in T.vectorized(4):
                                    with T.sblock("w_packed0_reindex_reindex"):
                                        v0 = T.axis.spatial(32, (ax1_ax0_fused_0 * 1024 + ax1_ax0_fused_1 * 4 + ax1_ax0_fused_2) % 32)
                                        v1 = T.axis.spatial(8, (ax1_ax0_fused_0 * 1024 + ax1_ax0_fused_1 * 4 + ax1_ax0_fused_2) // 32)
                                        T.where((ax1_ax0_fused_0 * 256 + ax1_ax0_fused_1) * 4 + ax1_ax0_fused_2 < 256)
                                        T.reads(w_packed0[v1, v0])
                                        T.writes(w_packed0_reindex_shared[v1, v0])
                                        w_packed0_reindex_shared[v1, v0] = w_packed0[v1, v0]
                        for k_1 in T.unroll(8):
                            for b_2 in T.unroll(8):
                                for n_2 in T.unroll(8):
                                    with T.sblock("x_proj0_update"):
                                        v_b = T.axis.spatial(80, b_1_n_1_fused // 16 * 8 + b_2)
                                        v_n = T.axis.spatial(32, b_1_n_1_fused % 16 * 8 + n_2)
                                        v_k = T.axis.reduce(8, k_0 * 8 + k_1)
                                        T.where((T.Mul(0, 16) + b_1_n_1_fused // 16) * 8 + b_2 < 80 and (T.Mul(0, 16) + b_1_n_1_fused % 16) * 8 + n_2 < 32)
                                        T.reads(x_proj0_local[v_b, v_n], x_reindex_shared[v_b, v_k], w_packed0_reindex_shared[v_k, v_n])
                                        T.writes(x_proj0_local[v_b, v_n])
                                        x_proj0_local[v_b, v_n] = x_proj0_local[v_b, v_n] + x_reindex_shared[v_b, v_k] * w_packed0_reindex_shared[v_k, v_n]
                    for ax0, ax1 in T.grid(8, 8):
                        with T.sblock("x_proj0_local"):
                            v0 = T.axis.spatial(80, b_1_n_1_fused // 16 * 8 + ax0)
                            v1 = T.axis.spatial(32, b_1_n_1_fused % 16 * 8 + ax1)
                            T.where(b_1_n_1_fused < 148 and b_1_n_1_fused % 16 < 4)
                            T.reads(x_proj0_local[v0, v1])
                            T.writes(x_proj0[v0, v1])
                            x_proj0[v0, v1] = x_proj0_local[v0, v1]
        with T.sblock("scan"):
            T.reads(x_proj0[0:80, 0:32], bias_ih[0:32], h0[0:2, 0:16])
            T.writes(h_seq[0:131, 0:16])
            h_prod = T.sblock_alloc_buffer((4, 16), "float64")
            h_part = T.sblock_alloc_buffer((4, 16), "float64")
            h_carry = T.sblock_alloc_buffer((4, 16), "float64")
            x_proj0_t = T.match_buffer(x_proj0[0:80, 0:32], (80, 32), offset_factor=1)
            for c_r_j_fused_0 in T.thread_binding(1, thread="blockIdx.x"):
                for c_r_j_fused_1 in T.thread_binding(256, thread="threadIdx.x"):
                    with T.sblock("chunk_h"):
                        vc = T.axis.spatial(2, (c_r_j_fused_0 * 256 + c_r_j_fused_1) // 32)
                        vr = T.axis.spatial(2, (c_r_j_fused_0 * 256 + c_r_j_fused_1) % 32 // 16)
                        vj = T.axis.spatial(16, (c_r_j_fused_0 * 256 + c_r_j_fused_1) % 16)
                        T.where(c_r_j_fused_0 * 256 + c_r_j_fused_1 < 64)
                        prod = T.Buffer((1,), "float64", scope="local")
                        acc = T.Buffer((1,), "float64", scope="local")
                        T.reads(prod[0], x_proj0_t[vc * 64 + vr:vc * 64 + vr + (T.min(32, 40 - vc * 32) * 2 - 1), vj:vj + 17], bias_ih[vj:vj + 17], acc[0])
                        T.writes(prod[0], acc[0], h_prod[vc * 2 + vr, vj], h_part[vc * 2 + vr, vj])
                        prod = T.sblock_alloc_buffer((1,), "float64", scope="local")
                        acc = T.sblock_alloc_buffer((1,), "float64", scope="local")
                        prod[0] = T.float64(1.0)
                        acc[0] = T.float64(0.0)
                        for t in range(T.min(32, 40 - vc * 32)):
                            prod[0] = prod[0] * T.Cast("float64", T.float32(1.0) - T.sigmoid(x_proj0_t[(vc * 32 + t) * 2 + vr, vj] + bias_ih[vj]))
                            acc[0] = T.Cast("float64", T.float32(1.0) - T.sigmoid(x_proj0_t[(vc * 32 + t) * 2 + vr, vj] + bias_ih[vj])) * acc[0] + T.Cast("float64", T.sigmoid(x_proj0_t[(vc * 32 + t) * 2 + vr, vj] + bias_ih[vj]) * (x_proj0_t[(vc * 32 + t) * 2 + vr, vj + 16] + bias_ih[vj + 16]))
                        h_prod[vc * 2 + vr, vj] = prod[0]
                        h_part[vc * 2 + vr, vj] = acc[0]
            for r_j_fused_0 in T.thread_binding(1, thread="blockIdx.x"):
                for r_j_fused_1 in T.thread_binding(256, thread="threadIdx.x"):
                    with T.sblock("carry_h"):
                        vr = T.axis.spatial(2, (r_j_fused_0 * 256 + r_j_fused_1) // 16)
                        vj = T.axis.spatial(16, (r_j_fused_0 * 256 + r_j_fused_1) % 16)
                        T.where(r_j_fused_0 * 256 + r_j_fused_1 < 32)
                        T.reads(h0[vr, vj], h_prod[vr:vr + 4, vj], h_part[vr:vr + 4, vj])
                        T.writes(h_seq[vr, vj], h_carry[vr:vr + 4, vj])
                        acc = T.sblock_alloc_buffer((1,), "float64", scope="local")
                        acc[0] = T.Cast("float64", h0[vr, vj])
                        h_seq[vr, vj] = h0[vr, vj]
                        for c in range(2):
                            h_carry[c * 2 + vr, vj] = acc[0]
                            acc[0] = h_prod[c * 2 + vr, vj] * acc[0] + h_part[c * 2 + vr, vj]
            for c_r_j_fused_0 in T.thread_binding(1, thread="blockIdx.x"):
                for c_r_j_fused_1 in T.thread_binding(256, thread="threadIdx.x"):
                    with T.sblock("apply_h"):
                        vc = T.axis.spatial(2, (c_r_j_fused_0 * 256 + c_r_j_fused_1) // 32)
                        vr = T.axis.spatial(2, (c_r_j_fused_0 * 256 + c_r_j_fused_1) % 32 // 16)
                        vj = T.axis.spatial(16, (c_r_j_fused_0 * 256 + c_r_j_fused_1) % 16)
                        T.where(c_r_j_fused_0 * 256 + c_r_j_fused_1 < 64)
                        acc = T.Buffer((1,), scope="local")
                        T.reads(h_carry[vc * 2 + vr, vj], x_proj0_t[vc * 64 + vr:vc * 64 + vr + (T.min(32, 40 - vc * 32) * 2 - 1), vj:vj + 17], bias_ih[vj:vj + 17], acc[0])
                        T.writes(acc[0], h_seq[vc * 64 + vr + 2:vc * 64 + vr + 2 + (T.min(32, 40 - vc * 32) * 2 - 1), vj])
                        acc = T.sblock_alloc_buffer((1,), scope="local")
                        acc[0] = T.Cast("float32", h_carry[vc * 2 + vr, vj])
                        for t in range(T.min(32, 40 - vc * 32)):
                            acc[0] = (T.float32(1.0) - T.sigmoid(x_proj0_t[(vc * 32 + t) * 2 + vr, vj] + bias_ih[vj])) * acc[0] + T.sigmoid(x_proj0_t[(vc * 32 + t) * 2 + vr, vj] + bias_ih[vj]) * (x_proj0_t[(vc * 32 + t) * 2 + vr, vj + 16] + bias_ih[vj + 16])
                            h_seq[(vc * 32 + t) * 2 + vr + 2, vj] = T.Cast("float32", acc[0])
