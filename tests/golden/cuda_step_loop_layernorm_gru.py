# from tvm.script import ir as I
# from tvm.script import tirx as T
# from tvm.tirx.layout import Axis

@I.ir_module
class Module:
    @T.prim_func(s_tir=True)
    def main(x: T.Buffer((6, 8), "float32"), h0: T.Buffer((2, 16), "float32"), weight_ih: T.Buffer((48, 8), "float32"), weight_hh: T.Buffer((48, 16), "float32"), bias_ih: T.Buffer((48,), "float32"), bias_hh: T.Buffer((48,), "float32"), gamma_ih: T.Buffer((48,), "float32"), gamma_hh: T.Buffer((48,), "float32"), h_seq: T.Buffer((8, 16), "float32")):
        T.func_attr({"tirx.noalias": True})
        # with T.sblock("root"):
        x_proj0 = T.alloc_buffer((6, 48))
        w_packed1 = T.alloc_buffer((16, 48))
        with T.sblock("prologue"):
            T.reads(weight_ih[0:48, 0:8], x[0:6, 0:8], weight_hh[0:48, 0:16], h0[0:2, 0:16])
            T.writes(x_proj0[0:6, 0:48], w_packed1[0:16, 0:48], h_seq[0:2, 0:16])
            w_packed0 = T.sblock_alloc_buffer((8, 48))
            x_reindex_shared = T.sblock_alloc_buffer((6, 8), scope="shared")
            w_packed0_reindex_shared = T.sblock_alloc_buffer((8, 48), scope="shared")
            x_proj0_local = T.sblock_alloc_buffer((6, 48), scope="local")
            w_packed0_shared = T.sblock_alloc_buffer((8, 48), scope="shared")
            w_packed1_shared = T.sblock_alloc_buffer((16, 48), scope="shared")
            h_init = T.match_buffer(h_seq[0:2, 0:16], (2, 16), offset_factor=1)
            for i0_0_i1_0_fused in T.thread_binding(2, thread="blockIdx.x"):
                for i1_1 in range(4):
                    for i1_2_i0_1_fused in T.thread_binding(256, thread="threadIdx.x"):
                        with T.sblock("w_packed0"):
                            v_i0 = T.axis.spatial(8, i1_2_i0_1_fused % 32)
                            v_i1 = T.axis.spatial(48, i0_0_i1_0_fused * 32 + i1_1 * 8 + i1_2_i0_1_fused // 32)
                            T.where(T.Mul(0, 32) + i1_2_i0_1_fused % 32 < 8 and (i0_0_i1_0_fused % 2 * 4 + i1_1) * 8 + i1_2_i0_1_fused // 32 < 48)
                            T.reads(weight_ih[v_i1, v_i0])
                            T.writes(w_packed0_shared[v_i0, v_i1])
                            T.sblock_attr({"buffer_dim_align": [[0, 0, 32, 1]]})
                            w_packed0_shared[v_i0, v_i1] = T.if_then_else(v_i1 < 48, weight_ih[v_i1, v_i0], T.float32(0.0))
                for ax0_ax1_fused_0 in range(1):
                    for ax0_ax1_fused_1 in T.thread_binding(256, thread="threadIdx.x"):
                        with T.sblock("w_packed0_shared"):
                            v0 = T.axis.spatial(8, (ax0_ax1_fused_0 * 256 + ax0_ax1_fused_1) // 32)
                            v1 = T.axis.spatial(48, i0_0_i1_0_fused * 32 + (ax0_ax1_fused_0 * 256 + ax0_ax1_fused_1) % 32)
                            T.where(i0_0_i1_0_fused * 32 + (ax0_ax1_fused_0 * 256 + ax0_ax1_fused_1) % 32 < 48)
                            T.reads(w_packed0_shared[v0, v1])
                            T.writes(w_packed0[v0, v1])
                            w_packed0[v0, v1] = w_packed0_shared[v0, v1]
            for b_0_n_0_fused in T.thread_binding(1, thread="blockIdx.x"):
                for b_1_n_1_fused in T.thread_binding(256, thread="threadIdx.x"):
                    for b_2_init in T.unroll(8):
                        for n_2_init in T.unroll(8):
                            with T.sblock("x_proj0_init"):
                                v_b = T.axis.spatial(6, b_1_n_1_fused // 16 * 8 + b_2_init)
                                v_n = T.axis.spatial(48, b_1_n_1_fused % 16 * 8 + n_2_init)
                                T.where((T.Mul(0, 16) + b_1_n_1_fused // 16) * 8 + b_2_init < 6 and (T.Mul(0, 16) + b_1_n_1_fused % 16) * 8 + n_2_init < 48)
                                T.reads()
                                T.writes(x_proj0_local[v_b, v_n])
                                x_proj0_local[v_b, v_n] = T.float32(0.0)
                    for k_0 in range(1):
                        for ax0_ax1_fused_0 in range(1):
                            for ax0_ax1_fused_1 in T.thread_binding(256, thread="threadIdx.x"):
                                for ax0_ax1_fused_2 in T.vectorized(4):
                                    with T.sblock("x_reindex_reindex"):
                                        v0 = T.axis.spatial(6, (ax0_ax1_fused_0 * 1024 + ax0_ax1_fused_1 * 4 + ax0_ax1_fused_2) // 8)
                                        v1 = T.axis.spatial(8, (ax0_ax1_fused_0 * 1024 + ax0_ax1_fused_1 * 4 + ax0_ax1_fused_2) % 8)
                                        T.where((ax0_ax1_fused_0 * 256 + ax0_ax1_fused_1) * 4 + ax0_ax1_fused_2 < 48)
                                        T.reads(x[v0, v1])
                                        T.writes(x_reindex_shared[v0, v1])
                                        x_reindex_shared[v0, v1] = x[v0, v1]
                        for ax1_ax0_fused_0 in range(1):
                            for ax1_ax0_fused_1 in T.thread_binding(256, thread="threadIdx.x"):
                                for ax1_ax0_fused_2 in T.vectorized(4):
                                    with T.sblock("w_packed0_reindex_reindex"):
                                        v0 = T.axis.spatial(48, (ax1_ax0_fused_0 * 1024 + ax1_ax0_fused_1 * 4 + ax1_ax0_fused_2) % 48)
                                        v1 = T.axis.spatial(8, (ax1_ax0_fused_0 * 1024 + ax1_ax0_fused_1 * 4 + ax1_ax0_fused_2) // 48)
                                        T.where((ax1_ax0_fused_0 * 256 + ax1_ax0_fused_1) * 4 + ax1_ax0_fused_2 < 384)
                                        T.reads(w_packed0[v1, v0])
                                        T.writes(w_packed0_reindex_shared[v1, v0])
                                        w_packed0_reindex_shared[v1, v0] = w_packed0[v1, v0]
                        for k_1 in T.unroll(8):
                            for b_2 in T.unroll(8):
                                for n_2 in T.unroll(8):
                                    with T.sblock("x_proj0_update"):
                                        v_b = T.axis.spatial(6, b_1_n_1_fused // 16 * 8 + b_2)
                                        v_n = T.axis.spatial(48, b_1_n_1_fused % 16 * 8 + n_2)
                                        v_k = T.axis.reduce(8, k_0 * 8 + k_1)
                                        T.where((T.Mul(0, 16) + b_1_n_1_fused // 16) * 8 + b_2 < 6 and (T.Mul(0, 16) + b_1_n_1_fused % 16) * 8 + n_2 < 48)
                                        T.reads(x_proj0_local[v_b, v_n], x_reindex_shared[v_b, v_k], w_packed0_reindex_shared[v_k, v_n])
                                        T.writes(x_proj0_local[v_b, v_n])
                                        x_proj0_local[v_b, v_n] = x_proj0_local[v_b, v_n] + x_reindex_shared[v_b, v_k] * w_packed0_reindex_shared[v_k, v_n]
                    for ax0, ax1 in T.grid(8, 8):
                        with T.sblock("x_proj0_local"):
                            v0 = T.axis.spatial(6, b_1_n_1_fused // 16 * 8 + ax0)
                            v1 = T.axis.spatial(48, b_1_n_1_fused % 16 * 8 + ax1)
                            T.where(b_1_n_1_fused // 16 * 8 + ax0 < 6 and b_1_n_1_fused % 16 < 6)
                            T.reads(x_proj0_local[v0, v1])
                            T.writes(x_proj0[v0, v1])
                            x_proj0[v0, v1] = x_proj0_local[v0, v1]
            for i0_0_i1_0_fused in T.thread_binding(2, thread="blockIdx.x"):
                for i1_1 in range(4):
                    for i1_2_i0_1_fused in T.thread_binding(256, thread="threadIdx.x"):
                        with T.sblock("w_packed1"):
                            v_i0 = T.axis.spatial(16, i1_2_i0_1_fused % 32)
                            v_i1 = T.axis.spatial(48, i0_0_i1_0_fused * 32 + i1_1 * 8 + i1_2_i0_1_fused // 32)
                            T.where(T.Mul(0, 32) + i1_2_i0_1_fused % 32 < 16 and (i0_0_i1_0_fused % 2 * 4 + i1_1) * 8 + i1_2_i0_1_fused // 32 < 48)
                            T.reads(weight_hh[v_i1, v_i0])
                            T.writes(w_packed1_shared[v_i0, v_i1])
                            T.sblock_attr({"buffer_dim_align": [[0, 0, 32, 1]]})
                            w_packed1_shared[v_i0, v_i1] = T.if_then_else(v_i1 < 48, weight_hh[v_i1, v_i0], T.float32(0.0))
                for ax0_ax1_fused_0 in range(2):
                    for ax0_ax1_fused_1 in T.thread_binding(256, thread="threadIdx.x"):
                        with T.sblock("w_packed1_shared"):
                            v0 = T.axis.spatial(16, (ax0_ax1_fused_0 * 256 + ax0_ax1_fused_1) // 32)
                            v1 = T.axis.spatial(48, i0_0_i1_0_fused * 32 + (ax0_ax1_fused_0 * 256 + ax0_ax1_fused_1) % 32)
                            T.where(i0_0_i1_0_fused * 32 + (ax0_ax1_fused_0 * 256 + ax0_ax1_fused_1) % 32 < 48)
                            T.reads(w_packed1_shared[v0, v1])
                            T.writes(w_packed1[v0, v1])
                            w_packed1[v0, v1] = w_packed1_shared[v0, v1]
            for i0_i1_0_fused_0 in T.thread_binding(1, thread="blockIdx.x"):
                for i0_i1_0_fused_1 in T.thread_binding(256, thread="threadIdx.x"):
                    for i1_1 in T.vectorized(4):
                        with T.sblock("h_init"):
                            v_i0 = T.axis.spatial(2, (i0_i1_0_fused_0 * 256 + i0_i1_0_fused_1) // 4)
                            v_i1 = T.axis.spatial(16, (i0_i1_0_fused_0 * 256 + i0_i1_0_fused_1) % 4 * 4 + i1_1)
                            T.where(i0_i1_0_fused_0 * 256 + i0_i1_0_fused_1 < 8)
                            T.reads(h0[v_i0, v_i1])
                            T.writes(h_init[v_i0, v_i1])
                            h_init[v_i0, v_i1] = h0[v_i0, v_i1]
        for t in range(3):
            with T.sblock("step"):
                T.reads(x_proj0[t * 2:t * 2 + 2, 0:48], gamma_ih[0:48], bias_ih[0:48], h_seq[t * 2:t * 2 + 2, 0:16], w_packed1[0:16, 0:48], gamma_hh[0:48], bias_hh[0:48])
                T.writes(h_seq[t * 2 + 2:t * 2 + 2 + 2, 0:16])
                x_proj0_weight_ih_sum_shared = T.sblock_alloc_buffer((2,), scope="shared")
                x_proj0_weight_ih_sqdev_shared = T.sblock_alloc_buffer((2,), scope="shared")
                gemm0 = T.sblock_alloc_buffer((2, 48))
                gemm0_weight_hh_sum_shared = T.sblock_alloc_buffer((2,), scope="shared")
                gemm0_weight_hh_sqdev_shared = T.sblock_alloc_buffer((2,), scope="shared")
                gemm0_operand_reindex_shared = T.sblock_alloc_buffer((2, 16), scope="shared")
                w_packed1_reindex_shared = T.sblock_alloc_buffer((16, 48), scope="shared")
                gemm0_local = T.sblock_alloc_buffer((2, 48), scope="local")
                x_proj0_t = T.match_buffer(x_proj0[t * 2:t * 2 + 2, 0:48], (2, 48), offset_factor=1)
                h_t = T.match_buffer(h_seq[t * 2:t * 2 + 2, 0:16], (2, 16), offset_factor=1)
                h_next = T.match_buffer(h_seq[t * 2 + 2:t * 2 + 2 + 2, 0:16], (2, 16), offset_factor=1)
                for b_0_n_0_fused in T.thread_binding(2, thread="blockIdx.x"):
                    for b_1_n_1_fused in T.thread_binding(32, thread="threadIdx.x"):
                        for b_2_init in T.unroll(1):
                            for n_2_init in T.unroll(2):
                                with T.sblock("gemm0_init"):
                                    v_b = T.axis.spatial(2, b_1_n_1_fused // 16 + b_2_init)
                                    v_n = T.axis.spatial(48, b_0_n_0_fused * 32 + b_1_n_1_fused % 16 * 2 + n_2_init)
                                    T.where((b_0_n_0_fused % 2 * 16 + b_1_n_1_fused % 16) * 2 + n_2_init < 48)
                                    T.reads()
                                    T.writes(gemm0_local[v_b, v_n])
                                    gemm0_local[v_b, v_n] = T.float32(0.0)
                        for k_0 in range(1):
                            for ax0_ax1_fused_0 in range(1):
                                for ax0_ax1_fused_1 in T.thread_binding(32, thread="threadIdx.x"):
                                    for ax0_ax1_fused_2 in T.vectorized(4):
                                        with T.sblock("gemm0_operand_reindex_reindex"):
                                            v0 = T.axis.spatial(2, (ax0_ax1_fused_0 * 128 + ax0_ax1_fused_1 * 4 + ax0_ax1_fused_2) // 16)
                                            v1 = T.axis.spatial(16, (ax0_ax1_fused_0 * 128 + ax0_ax1_fused_1 * 4 + ax0_ax1_fused_2) % 16)
                                            T.where((ax0_ax1_fused_0 * 32 + ax0_ax1_fused_1) * 4 + ax0_ax1_fused_2 < 32)
                                            T.reads(h_t[v0, v1])
                                            T.writes(gemm0_operand_reindex_shared[v0, v1])
                                            gemm0_operand_reindex_shared[v0, v1] = h_t[v0, v1]
                            for ax1_ax0_fused_0 in range(4):
                                for ax1_ax0_fused_1 in T.thread_binding(32, thread="threadIdx.x"):
                                    for ax1_ax0_fused_2 in T.vectorized(4):
                                        with T.sblock("w_packed1_reindex_reindex"):
                                            v0 = T.axis.spatial(48, b_0_n_0_fused * 32 + (ax1_ax0_fused_0 * 128 + ax1_ax0_fused_1 * 4 + ax1_ax0_fused_2) % 32)
                                            v1 = T.axis.spatial(16, (ax1_ax0_fused_0 * 128 + ax1_ax0_fused_1 * 4 + ax1_ax0_fused_2) // 32)
                                            T.where(b_0_n_0_fused * 32 + ((ax1_ax0_fused_0 * 32 + ax1_ax0_fused_1) * 4 + ax1_ax0_fused_2) % 32 < 48)
                                            T.reads(w_packed1[v1, v0])
                                            T.writes(w_packed1_reindex_shared[v1, v0])
                                            w_packed1_reindex_shared[v1, v0] = w_packed1[v1, v0]
                            for k_1 in T.unroll(16):
                                for b_2 in T.unroll(1):
                                    for n_2 in T.unroll(2):
                                        with T.sblock("gemm0_update"):
                                            v_b = T.axis.spatial(2, b_1_n_1_fused // 16 + b_2)
                                            v_n = T.axis.spatial(48, b_0_n_0_fused * 32 + b_1_n_1_fused % 16 * 2 + n_2)
                                            v_k = T.axis.reduce(16, k_0 * 16 + k_1)
                                            T.where((b_0_n_0_fused % 2 * 16 + b_1_n_1_fused % 16) * 2 + n_2 < 48)
                                            T.reads(gemm0_local[v_b, v_n], gemm0_operand_reindex_shared[v_b, v_k], w_packed1_reindex_shared[v_k, v_n])
                                            T.writes(gemm0_local[v_b, v_n])
                                            gemm0_local[v_b, v_n] = gemm0_local[v_b, v_n] + gemm0_operand_reindex_shared[v_b, v_k] * w_packed1_reindex_shared[v_k, v_n]
                        for ax0 in range(2):
                            with T.sblock("gemm0_local"):
                                v0 = T.axis.spatial(2, b_1_n_1_fused // 16)
                                v1 = T.axis.spatial(48, b_0_n_0_fused * 32 + b_1_n_1_fused % 16 * 2 + ax0)
                                T.where(b_0_n_0_fused * 2 + b_1_n_1_fused % 16 // 8 < 3)
                                T.reads(gemm0_local[v0, v1])
                                T.writes(gemm0[v0, v1])
                                gemm0[v0, v1] = gemm0_local[v0, v1]
                for i0 in T.thread_binding(2, thread="blockIdx.x"):
                    for ax0_0 in range(1):
                        for ax0_1 in T.thread_binding(64, thread="threadIdx.x"):
                            with T.sblock("gemm0_weight_hh_sum"):
                                v_b = T.axis.spatial(2, i0)
                                v_k = T.axis.reduce(48, ax0_0 * 64 + ax0_1)
                                T.where(ax0_0 * 64 + ax0_1 < 48)
                                T.reads(gemm0[v_b, v_k])
                                T.writes(gemm0_weight_hh_sum_shared[v_b])
                                with T.init():
                                    gemm0_weight_hh_sum_shared[v_b] = T.float32(0.0)
                                gemm0_weight_hh_sum_shared[v_b] = gemm0_weight_hh_sum_shared[v_b] + gemm0[v_b, v_k]
                    for ax0_0 in range(1):
                        for ax0_1 in T.thread_binding(64, thread="threadIdx.x"):
                            with T.sblock("gemm0_weight_hh_sqdev"):
                                v_b = T.axis.spatial(2, i0)
                                v_k = T.axis.reduce(48, ax0_0 * 64 + ax0_1)
                                T.where(ax0_0 * 64 + ax0_1 < 48)
                                T.reads(gemm0[v_b, v_k], gemm0_weight_hh_sum_shared[v_b])
                                T.writes(gemm0_weight_hh_sqdev_shared[v_b])
                                with T.init():
                                    gemm0_weight_hh_sqdev_shared[v_b] = T.float32(0.0)
                                gemm0_weight_hh_sqdev_shared[v_b] = gemm0_weight_hh_sqdev_shared[v_b] + (gemm0[v_b, v_k] - gemm0_weight_hh_sum_shared[v_b] / T.float32(48.0)) * (gemm0[v_b, v_k] - gemm0_weight_hh_sum_shared[v_b] / T.float32(48.0))
                    for ax0_0 in range(1):
                        for ax0_1 in T.thread_binding(64, thread="threadIdx.x"):
                            with T.sblock("x_proj0_weight_ih_sum"):
                                v_b = T.axis.spatial(2, i0)
                                v_k = T.axis.reduce(48, ax0_0 * 64 + ax0_1)
                                T.where(ax0_0 * 64 + ax0_1 < 48)
                                T.reads(x_proj0_t[v_b, v_k])
                                T.writes(x_proj0_weight_ih_sum_shared[v_b])
                                with T.init():
                                    x_proj0_weight_ih_sum_shared[v_b] = T.float32(0.0)
                                x_proj0_weight_ih_sum_shared[v_b] = x_proj0_weight_ih_sum_shared[v_b] + x_proj0_t[v_b, v_k]
                    for ax0_0 in range(1):
                        for ax0_1 in T.thread_binding(64, thread="threadIdx.x"):
                            with T.sblock("x_proj0_weight_ih_sqdev"):
                                v_b = T.axis.spatial(2, i0)
                                v_k = T.axis.reduce(48, ax0_0 * 64 + ax0_1)
                                T.where(ax0_0 * 64 + ax0_1 < 48)
                                T.reads(x_proj0_t[v_b, v_k], x_proj0_weight_ih_sum_shared[v_b])
                                T.writes(x_proj0_weight_ih_sqdev_shared[v_b])
                                with T.init():
                                    x_proj0_weight_ih_sqdev_shared[v_b] = T.float32(0.0)
                                x_proj0_weight_ih_sqdev_shared[v_b] = x_proj0_weight_ih_sqdev_shared[v_b] + (x_proj0_t[v_b, v_k] - x_proj0_weight_ih_sum_shared[v_b] / T.float32(48.0)) * (x_proj0_t[v_b, v_k] - x_proj0_weight_ih_sum_shared[v_b] / T.float32(48.0))
                    for i1_0 in range(1):
                        for i1_1 in T.thread_binding(64, thread="threadIdx.x"):
                            with T.sblock("h_next"):
                                v_i0 = T.axis.spatial(2, i0)
                                v_i1 = T.axis.spatial(16, i1_0 * 64 + i1_1)
                                T.where(i1_0 * 64 + i1_1 < 16)
                                T.reads(x_proj0_t[v_i0, v_i1:v_i1 + 33], x_proj0_weight_ih_sum_shared[v_i0], x_proj0_weight_ih_sqdev_shared[v_i0], gamma_ih[v_i1:v_i1 + 33], bias_ih[v_i1:v_i1 + 33], gemm0[v_i0, v_i1:v_i1 + 33], gemm0_weight_hh_sum_shared[v_i0], gemm0_weight_hh_sqdev_shared[v_i0], gamma_hh[v_i1:v_i1 + 33], bias_hh[v_i1:v_i1 + 33], h_t[v_i0, v_i1])
                                T.writes(h_next[v_i0, v_i1])
                                h_next[v_i0, v_i1] = (T.float32(1.0) - T.sigmoid((x_proj0_t[v_i0, v_i1 + 16] - x_proj0_weight_ih_sum_shared[v_i0] / T.float32(48.0)) * T.rsqrt(x_proj0_weight_ih_sqdev_shared[v_i0] / T.float32(48.0) + T.float32(1.0000000000000001e-05)) * gamma_ih[v_i1 + 16] + bias_ih[v_i1 + 16] + ((gemm0[v_i0, v_i1 + 16] - gemm0_weight_hh_sum_shared[v_i0] / T.float32(48.0)) * T.rsqrt(gemm0_weight_hh_sqdev_shared[v_i0] / T.float32(48.0) + T.float32(1.0000000000000001e-05)) * gamma_hh[v_i1 + 16] + bias_hh[v_i1 + 16]))) * T.tanh((x_proj0_t[v_i0, v_i1 + 32] - x_proj0_weight_ih_sum_shared[v_i0] / T.float32(48.0)) * T.rsqrt(x_proj0_weight_ih_sqdev_shared[v_i0] / T.float32(48.0) + T.float32(1.0000000000000001e-05)) * gamma_ih[v_i1 + 32] + bias_ih[v_i1 + 32] + T.sigmoid((x_proj0_t[v_i0, v_i1] - x_proj0_weight_ih_sum_shared[v_i0] / T.float32(48.0)) * T.rsqrt(x_proj0_weight_ih_sqdev_shared[v_i0] / T.float32(48.0) + T.float32(1.0000000000000001e-05)) * gamma_ih[v_i1] + bias_ih[v_i1] + ((gemm0[v_i0, v_i1] - gemm0_weight_hh_sum_shared[v_i0] / T.float32(48.0)) * T.rsqrt(gemm0_weight_hh_sqdev_shared[v_i0] / T.float32(48.0) + T.float32(1.0000000000000001e-05)) * gamma_hh[v_i1] + bias_hh[v_i1])) * ((gemm0[v_i0, v_i1 + 32] - gemm0_weight_hh_sum_shared[v_i0] / T.float32(48.0)) * T.rsqrt(gemm0_weight_hh_sqdev_shared[v_i0] / T.float32(48.0) + T.float32(1.0000000000000001e-05)) * gamma_hh[v_i1 + 32] + bias_hh[v_i1 + 32])) + T.sigmoid((x_proj0_t[v_i0, v_i1 + 16] - x_proj0_weight_ih_sum_shared[v_i0] / T.float32(48.0)) * T.rsqrt(x_proj0_weight_ih_sqdev_shared[v_i0] / T.float32(48.0) + T.float32(1.0000000000000001e-05)) * gamma_ih[v_i1 + 16] + bias_ih[v_i1 + 16] + ((gemm0[v_i0, v_i1 + 16] - gemm0_weight_hh_sum_shared[v_i0] / T.float32(48.0)) * T.rsqrt(gemm0_weight_hh_sqdev_shared[v_i0] / T.float32(48.0) + T.float32(1.0000000000000001e-05)) * gamma_hh[v_i1 + 16] + bias_hh[v_i1 + 16])) * h_t[v_i0, v_i1]
