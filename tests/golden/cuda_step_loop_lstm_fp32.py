# from tvm.script import ir as I
# from tvm.script import tirx as T
# from tvm.tirx.layout import Axis

@I.ir_module
class Module:
    @T.prim_func(s_tir=True)
    def main(x: T.Buffer((6, 8), "float32"), h0: T.Buffer((2, 16), "float32"), c0: T.Buffer((2, 16), "float32"), weight_ih: T.Buffer((64, 8), "float32"), weight_hh: T.Buffer((64, 16), "float32"), bias_ih: T.Buffer((64,), "float32"), bias_hh: T.Buffer((64,), "float32"), h_seq: T.Buffer((8, 16), "float32"), c_seq: T.Buffer((8, 16), "float32")):
        T.func_attr({"tirx.noalias": True})
        # with T.sblock("root"):
        x_proj0 = T.alloc_buffer((6, 64))
        w_packed1 = T.alloc_buffer((16, 64))
        with T.sblock("prologue"):
            T.reads(weight_ih[0:64, 0:8], x[0:6, 0:8], weight_hh[0:64, 0:16], h0[0:2, 0:16], c0[0:2, 0:16])
            T.writes(x_proj0[0:6, 0:64], w_packed1[0:16, 0:64], h_seq[0:2, 0:16], c_seq[0:2, 0:16])
            w_packed0 = T.sblock_alloc_buffer((8, 64))
            x_reindex_shared = T.sblock_alloc_buffer((6, 8), scope="shared")
            w_packed0_reindex_shared = T.sblock_alloc_buffer((8, 64), scope="shared")
            x_proj0_local = T.sblock_alloc_buffer((6, 64), scope="local")
            w_packed0_shared = T.sblock_alloc_buffer((8, 64), scope="shared")
            w_packed1_shared = T.sblock_alloc_buffer((16, 64), scope="shared")
            h_init = T.match_buffer(h_seq[0:2, 0:16], (2, 16), offset_factor=1)
            c_init = T.match_buffer(c_seq[0:2, 0:16], (2, 16), offset_factor=1)
            for i0_0_i1_0_fused in T.thread_binding(2, thread="blockIdx.x"):
                for i1_1 in range(4):
                    for i1_2_i0_1_fused in T.thread_binding(256, thread="threadIdx.x"):
                        with T.sblock("w_packed0"):
                            v_i0 = T.axis.spatial(8, i1_2_i0_1_fused % 32)
                            v_i1 = T.axis.spatial(64, i0_0_i1_0_fused * 32 + i1_1 * 8 + i1_2_i0_1_fused // 32)
                            T.where(T.Mul(0, 32) + i1_2_i0_1_fused % 32 < 8)
                            T.reads(weight_ih[v_i1, v_i0])
                            T.writes(w_packed0_shared[v_i0, v_i1])
                            T.sblock_attr({"buffer_dim_align": [[0, 0, 32, 1]]})
                            w_packed0_shared[v_i0, v_i1] = T.if_then_else(v_i1 < 64, weight_ih[v_i1, v_i0], T.float32(0.0))
                for ax0_ax1_fused_0 in range(1):
                    for ax0_ax1_fused_1 in T.thread_binding(256, thread="threadIdx.x"):
                        with T.sblock("w_packed0_shared"):
                            v0 = T.axis.spatial(8, (ax0_ax1_fused_0 * 256 + ax0_ax1_fused_1) // 32)
                            v1 = T.axis.spatial(64, i0_0_i1_0_fused * 32 + (ax0_ax1_fused_0 * 256 + ax0_ax1_fused_1) % 32)
                            T.reads(w_packed0_shared[v0, v1])
                            T.writes(w_packed0[v0, v1])
                            w_packed0[v0, v1] = w_packed0_shared[v0, v1]
            for b_0_n_0_fused in T.thread_binding(1, thread="blockIdx.x"):
                for b_1_n_1_fused in T.thread_binding(256, thread="threadIdx.x"):
                    for b_2_init in T.unroll(8):
                        for n_2_init in T.unroll(8):
                            with T.sblock("x_proj0_init"):
                                v_b = T.axis.spatial(6, b_1_n_1_fused // 16 * 8 + b_2_init)
                                v_n = T.axis.spatial(64, b_1_n_1_fused % 16 * 8 + n_2_init)
                                T.where((T.Mul(0, 16) + b_1_n_1_fused // 16) * 8 + b_2_init < 6 and (T.Mul(0, 16) + b_1_n_1_fused % 16) * 8 + n_2_init < 64)
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
                                        v0 = T.axis.spatial(64, (ax1_ax0_fused_0 * 1024 + ax1_ax0_fused_1 * 4 + ax1_ax0_fused_2) % 64)
                                        v1 = T.axis.spatial(8, (ax1_ax0_fused_0 * 1024 + ax1_ax0_fused_1 * 4 + ax1_ax0_fused_2) // 64)
                                        T.where((ax1_ax0_fused_0 * 256 + ax1_ax0_fused_1) * 4 + ax1_ax0_fused_2 < 512)
                                        T.reads(w_packed0[v1, v0])
                                        T.writes(w_packed0_reindex_shared[v1, v0])
                                        w_packed0_reindex_shared[v1, v0] = w_packed0[v1, v0]
                        for k_1 in T.unroll(8):
                            for b_2 in T.unroll(8):
                                for n_2 in T.unroll(8):
                                    with T.sblock("x_proj0_update"):
                                        v_b = T.axis.spatial(6, b_1_n_1_fused // 16 * 8 + b_2)
                                        v_n = T.axis.spatial(64, b_1_n_1_fused % 16 * 8 + n_2)
                                        v_k = T.axis.reduce(8, k_0 * 8 + k_1)
                                        T.where((T.Mul(0, 16) + b_1_n_1_fused // 16) * 8 + b_2 < 6 and (T.Mul(0, 16) + b_1_n_1_fused % 16) * 8 + n_2 < 64)
                                        T.reads(x_proj0_local[v_b, v_n], x_reindex_shared[v_b, v_k], w_packed0_reindex_shared[v_k, v_n])
                                        T.writes(x_proj0_local[v_b, v_n])
                                        x_proj0_local[v_b, v_n] = x_proj0_local[v_b, v_n] + x_reindex_shared[v_b, v_k] * w_packed0_reindex_shared[v_k, v_n]
                    for ax0, ax1 in T.grid(8, 8):
                        with T.sblock("x_proj0_local"):
                            v0 = T.axis.spatial(6, b_1_n_1_fused // 16 * 8 + ax0)
                            v1 = T.axis.spatial(64, b_1_n_1_fused % 16 * 8 + ax1)
                            T.where(b_1_n_1_fused // 16 * 8 + ax0 < 6 and b_1_n_1_fused % 16 < 8)
                            T.reads(x_proj0_local[v0, v1])
                            T.writes(x_proj0[v0, v1])
                            x_proj0[v0, v1] = x_proj0_local[v0, v1]
            for i0_0_i1_0_fused in T.thread_binding(2, thread="blockIdx.x"):
                for i1_1 in range(4):
                    for i1_2_i0_1_fused in T.thread_binding(256, thread="threadIdx.x"):
                        with T.sblock("w_packed1"):
                            v_i0 = T.axis.spatial(16, i1_2_i0_1_fused % 32)
                            v_i1 = T.axis.spatial(64, i0_0_i1_0_fused * 32 + i1_1 * 8 + i1_2_i0_1_fused // 32)
                            T.where(T.Mul(0, 32) + i1_2_i0_1_fused % 32 < 16)
                            T.reads(weight_hh[v_i1, v_i0])
                            T.writes(w_packed1_shared[v_i0, v_i1])
                            T.sblock_attr({"buffer_dim_align": [[0, 0, 32, 1]]})
                            w_packed1_shared[v_i0, v_i1] = T.if_then_else(v_i1 < 64, weight_hh[v_i1, v_i0], T.float32(0.0))
                for ax0_ax1_fused_0 in range(2):
                    for ax0_ax1_fused_1 in T.thread_binding(256, thread="threadIdx.x"):
                        with T.sblock("w_packed1_shared"):
                            v0 = T.axis.spatial(16, (ax0_ax1_fused_0 * 256 + ax0_ax1_fused_1) // 32)
                            v1 = T.axis.spatial(64, i0_0_i1_0_fused * 32 + (ax0_ax1_fused_0 * 256 + ax0_ax1_fused_1) % 32)
                            T.reads(w_packed1_shared[v0, v1])
                            T.writes(w_packed1[v0, v1])
                            w_packed1[v0, v1] = w_packed1_shared[v0, v1]
            for i0_m_i1_m_0_fused_0 in T.thread_binding(1, thread="blockIdx.x"):
                for i0_m_i1_m_0_fused_1 in T.thread_binding(256, thread="threadIdx.x"):
                    for i1_m_1 in T.vectorized(4):
                        with T.sblock("h_init"):
                            v_i0 = T.axis.spatial(2, (i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1) // 4)
                            v_i1 = T.axis.spatial(16, (i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1) % 4 * 4 + i1_m_1)
                            T.where(i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1 < 8)
                            T.reads(h0[v_i0, v_i1])
                            T.writes(h_init[v_i0, v_i1])
                            h_init[v_i0, v_i1] = h0[v_i0, v_i1]
                        with T.sblock("c_init"):
                            v_i0 = T.axis.spatial(2, (i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1) // 4)
                            v_i1 = T.axis.spatial(16, (i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1) % 4 * 4 + i1_m_1)
                            T.where(i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1 < 8)
                            T.reads(c0[v_i0, v_i1])
                            T.writes(c_init[v_i0, v_i1])
                            c_init[v_i0, v_i1] = c0[v_i0, v_i1]
        for t in range(3):
            with T.sblock("step"):
                T.reads(x_proj0[t * 2:t * 2 + 2, 0:64], bias_ih[0:64], h_seq[t * 2:t * 2 + 2, 0:16], w_packed1[0:16, 0:64], bias_hh[0:64], c_seq[t * 2:t * 2 + 2, 0:16])
                T.writes(h_seq[t * 2 + 2:t * 2 + 2 + 2, 0:16], c_seq[t * 2 + 2:t * 2 + 2 + 2, 0:16])
                gemm0 = T.sblock_alloc_buffer((2, 64))
                gemm0_operand_reindex_shared = T.sblock_alloc_buffer((2, 16), scope="shared")
                w_packed1_reindex_shared = T.sblock_alloc_buffer((16, 64), scope="shared")
                gemm0_local = T.sblock_alloc_buffer((2, 64), scope="local")
                x_proj0_t = T.match_buffer(x_proj0[t * 2:t * 2 + 2, 0:64], (2, 64), offset_factor=1)
                h_t = T.match_buffer(h_seq[t * 2:t * 2 + 2, 0:16], (2, 16), offset_factor=1)
                c_t = T.match_buffer(c_seq[t * 2:t * 2 + 2, 0:16], (2, 16), offset_factor=1)
                h_next = T.match_buffer(h_seq[t * 2 + 2:t * 2 + 2 + 2, 0:16], (2, 16), offset_factor=1)
                c_next = T.match_buffer(c_seq[t * 2 + 2:t * 2 + 2 + 2, 0:16], (2, 16), offset_factor=1)
                for b_0_n_0_fused in T.thread_binding(2, thread="blockIdx.x"):
                    for b_1_n_1_fused in T.thread_binding(32, thread="threadIdx.x"):
                        for b_2_init in T.unroll(1):
                            for n_2_init in T.unroll(2):
                                with T.sblock("gemm0_init"):
                                    v_b = T.axis.spatial(2, b_1_n_1_fused // 16 + b_2_init)
                                    v_n = T.axis.spatial(64, b_0_n_0_fused * 32 + b_1_n_1_fused % 16 * 2 + n_2_init)
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
                                            v0 = T.axis.spatial(64, b_0_n_0_fused * 32 + (ax1_ax0_fused_0 * 128 + ax1_ax0_fused_1 * 4 + ax1_ax0_fused_2) % 32)
                                            v1 = T.axis.spatial(16, (ax1_ax0_fused_0 * 128 + ax1_ax0_fused_1 * 4 + ax1_ax0_fused_2) // 32)
                                            T.reads(w_packed1[v1, v0])
                                            T.writes(w_packed1_reindex_shared[v1, v0])
                                            w_packed1_reindex_shared[v1, v0] = w_packed1[v1, v0]
                            for k_1 in T.unroll(16):
                                for b_2 in T.unroll(1):
                                    for n_2 in T.unroll(2):
                                        with T.sblock("gemm0_update"):
                                            v_b = T.axis.spatial(2, b_1_n_1_fused // 16 + b_2)
                                            v_n = T.axis.spatial(64, b_0_n_0_fused * 32 + b_1_n_1_fused % 16 * 2 + n_2)
                                            v_k = T.axis.reduce(16, k_0 * 16 + k_1)
                                            T.reads(gemm0_local[v_b, v_n], gemm0_operand_reindex_shared[v_b, v_k], w_packed1_reindex_shared[v_k, v_n])
                                            T.writes(gemm0_local[v_b, v_n])
                                            gemm0_local[v_b, v_n] = gemm0_local[v_b, v_n] + gemm0_operand_reindex_shared[v_b, v_k] * w_packed1_reindex_shared[v_k, v_n]
                        for ax0 in range(2):
                            with T.sblock("gemm0_local"):
                                v0 = T.axis.spatial(2, b_1_n_1_fused // 16)
                                v1 = T.axis.spatial(64, b_0_n_0_fused * 32 + b_1_n_1_fused % 16 * 2 + ax0)
                                T.reads(gemm0_local[v0, v1])
                                T.writes(gemm0[v0, v1])
                                gemm0[v0, v1] = gemm0_local[v0, v1]
                for i0_m_i1_m_0_fused_0 in T.thread_binding(1, thread="blockIdx.x"):
                    for i0_m_i1_m_0_fused_1 in T.thread_binding(256, thread="threadIdx.x"):
                        for i1_m_1 in T.vectorized(4):
                            with T.sblock("h_next"):
                                v_i0 = T.axis.spatial(2, (i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1) // 4)
                                v_i1 = T.axis.spatial(16, (i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1) % 4 * 4 + i1_m_1)
                                T.where(i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1 < 8)
                                T.reads(x_proj0_t[v_i0, v_i1:v_i1 + 49], bias_ih[v_i1:v_i1 + 49], gemm0[v_i0, v_i1:v_i1 + 49], bias_hh[v_i1:v_i1 + 49], c_t[v_i0, v_i1])
                                T.writes(h_next[v_i0, v_i1])
                                h_next[v_i0, v_i1] = T.sigmoid(x_proj0_t[v_i0, v_i1 + 48] + bias_ih[v_i1 + 48] + (gemm0[v_i0, v_i1 + 48] + bias_hh[v_i1 + 48])) * T.tanh(T.sigmoid(x_proj0_t[v_i0, v_i1 + 16] + bias_ih[v_i1 + 16] + (gemm0[v_i0, v_i1 + 16] + bias_hh[v_i1 + 16])) * c_t[v_i0, v_i1] + T.sigmoid(x_proj0_t[v_i0, v_i1] + bias_ih[v_i1] + (gemm0[v_i0, v_i1] + bias_hh[v_i1])) * T.tanh(x_proj0_t[v_i0, v_i1 + 32] + bias_ih[v_i1 + 32] + (gemm0[v_i0, v_i1 + 32] + bias_hh[v_i1 + 32])))
                            with T.sblock("c_next"):
                                v_i0 = T.axis.spatial(2, (i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1) // 4)
                                v_i1 = T.axis.spatial(16, (i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1) % 4 * 4 + i1_m_1)
                                T.where(i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1 < 8)
                                T.reads(x_proj0_t[v_i0, v_i1:v_i1 + 33], bias_ih[v_i1:v_i1 + 33], gemm0[v_i0, v_i1:v_i1 + 33], bias_hh[v_i1:v_i1 + 33], c_t[v_i0, v_i1])
                                T.writes(c_next[v_i0, v_i1])
                                c_next[v_i0, v_i1] = T.sigmoid(x_proj0_t[v_i0, v_i1 + 16] + bias_ih[v_i1 + 16] + (gemm0[v_i0, v_i1 + 16] + bias_hh[v_i1 + 16])) * c_t[v_i0, v_i1] + T.sigmoid(x_proj0_t[v_i0, v_i1] + bias_ih[v_i1] + (gemm0[v_i0, v_i1] + bias_hh[v_i1])) * T.tanh(x_proj0_t[v_i0, v_i1 + 32] + bias_ih[v_i1 + 32] + (gemm0[v_i0, v_i1 + 32] + bias_hh[v_i1 + 32]))
