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
        with T.sblock("prologue"):
            T.reads(weight_ih[0:64, 0:8], x[0:6, 0:8])
            T.writes(x_proj0[0:6, 0:64])
            w_packed0 = T.sblock_alloc_buffer((8, 64))
            x_reindex_shared = T.sblock_alloc_buffer((6, 8), scope="shared")
            w_packed0_reindex_shared = T.sblock_alloc_buffer((8, 64), scope="shared")
            x_proj0_local = T.sblock_alloc_buffer((6, 64), scope="local")
            w_packed0_shared = T.sblock_alloc_buffer((8, 64), scope="shared")
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
        for p_bx in T.thread_binding(16, thread="blockIdx.x"):
            for p_tx in T.thread_binding(256, thread="threadIdx.x"):
                with T.sblock("persistent"):
                    T.reads(h0[0:2, 0:16], c0[0:2, 0:16], weight_hh[0:64, 0:16], x_proj0[0:6, 0:64], bias_ih[0:64], bias_hh[0:64], c_seq[0:8, 0:16], h_seq[0:8, 0:16])
                    T.writes(h_seq[0:8, 0:16], c_seq[0:8, 0:16])
                    w_s1 = T.sblock_alloc_buffer((80,), scope="shared.dyn")
                    part1 = T.sblock_alloc_buffer((2056,), scope="shared.dyn")
                    a_s1 = T.sblock_alloc_buffer((40,), scope="shared.dyn")
                    x_s0 = T.sblock_alloc_buffer((8,), scope="shared.dyn")
                    acc = T.sblock_alloc_buffer((8,), scope="local")
                    a_r = T.sblock_alloc_buffer((8,), scope="local")
                    w_r = T.sblock_alloc_buffer((16,), scope="local")
                    for p_r in range(1):
                        if (p_r * 16 + p_bx) * 256 + p_tx < 32:
                            for p_v in T.vectorized(1):
                                h_seq[((p_r * 16 + p_bx) * 256 + p_tx + p_v) // 16, ((p_r * 16 + p_bx) * 256 + p_tx + p_v) % 16] = h0[((p_r * 16 + p_bx) * 256 + p_tx + p_v) // 16, ((p_r * 16 + p_bx) * 256 + p_tx + p_v) % 16]
                    for p_r in range(1):
                        if (p_r * 16 + p_bx) * 256 + p_tx < 32:
                            for p_v in T.vectorized(1):
                                c_seq[((p_r * 16 + p_bx) * 256 + p_tx + p_v) // 16, ((p_r * 16 + p_bx) * 256 + p_tx + p_v) % 16] = c0[((p_r * 16 + p_bx) * 256 + p_tx + p_v) // 16, ((p_r * 16 + p_bx) * 256 + p_tx + p_v) % 16]
                    for p_r in range(1):
                        w_s1[T.min(p_r * 256 + p_tx, 79)] = T.if_then_else(T.min(p_r * 256 + p_tx, 79) % 20 < 16, T.if_then_else(T.min(p_r * 256 + p_tx, 79) // 20 * 16 + p_bx < 64, weight_hh[T.min(p_r * 256 + p_tx, 79) // 20 * 16 + p_bx, T.min(T.min(p_r * 256 + p_tx, 79) % 20, 15)], T.float32(0.0)), T.Cast("float32", T.float32(0.0)))
                    for p_r in range(9):
                        part1[T.min(p_r * 256 + p_tx, 2055)] = T.Cast("float32", T.float32(0.0))
                    for p_r in range(1):
                        a_s1[T.min(p_r * 256 + p_tx, 39)] = T.Cast("float32", T.float32(0.0))
                    for p_r in range(1):
                        x_s0[T.min(p_r * 256 + p_tx, 7)] = T.Cast("float32", T.float32(0.0))
                    for p_r in range(1):
                        if (p_r * 16 + p_bx) * 256 + p_tx < 24:
                            for p_v in T.vectorized(4):
                                h_seq[2 + (((p_r * 16 + p_bx) * 256 + p_tx) * 4 + p_v) // 16, (((p_r * 16 + p_bx) * 256 + p_tx) * 4 + p_v) % 16] = T.reinterpret("float32", T.uint32(4294967295))
                    T.cuda.grid_sync()
                    for t in range(3):
                        with T.sblock("step"):
                            T.reads(x_proj0[0:6, 0:64], a_s1[0:40], w_s1[0:80], acc[0:8], a_r[0:8], w_r[0:16], x_s0[0:8], bias_ih[0:64], part1[0:2056], bias_hh[0:64], c_seq[0:8, 0:16], h_seq[0:8, 0:16])
                            T.writes(x_s0[0:8], acc[0:8], a_r[0:8], w_r[0:16], part1[0:2056], h_seq[0:8, 0:16], c_seq[0:8, 0:16], a_s1[0:40])
                            x_proj0_t = T.match_buffer(x_proj0[t * 2:t * 2 + 2, 0:64], (2, 64), offset_factor=1)
                            h_t = T.match_buffer(h_seq[t * 2:t * 2 + 2, 0:16], (2, 16), offset_factor=1)
                            c_t = T.match_buffer(c_seq[t * 2:t * 2 + 2, 0:16], (2, 16), offset_factor=1)
                            h_next = T.match_buffer(h_seq[t * 2 + 2:t * 2 + 2 + 2, 0:16], (2, 16), offset_factor=1)
                            c_next = T.match_buffer(c_seq[t * 2 + 2:t * 2 + 2 + 2, 0:16], (2, 16), offset_factor=1)
                            for p_r in range(1):
                                x_s0[T.min(p_r * 256 + p_tx, 7)] = x_proj0_t[T.min(p_r * 256 + p_tx, 7) // 4, T.min(p_r * 256 + p_tx, 7) % 4 * 16 + p_bx]
                            T.tvm_storage_sync("shared", T.bool(False), -1)
                            for p_r in range(1):
                                T.call_extern("void", "halstm_poll_stage<16, 4>", t > 0, T.tvm_access_ptr(T.type_annotation("float32"), a_s1.data, T.min(p_r * 256 + p_tx, 7) // 4 * 20 + T.min(p_r * 256 + p_tx, 7) % 4 * 4, 40 - (T.min(p_r * 256 + p_tx, 7) // 4 * 20 + T.min(p_r * 256 + p_tx, 7) % 4 * 4), 2), T.tvm_access_ptr(T.type_annotation("float32"), h_t.data, h_t.elem_offset + (T.min(p_r * 256 + p_tx, 7) // 4 * 16 + T.min(p_r * 256 + p_tx, 7) % 4 * 4), 32 - (T.min(p_r * 256 + p_tx, 7) // 4 * 16 + T.min(p_r * 256 + p_tx, 7) % 4 * 4), 1))
                            T.tvm_storage_sync("shared", T.bool(False), -1)
                            for p_i in T.unroll(8):
                                acc[p_i] = T.float32(0.0)
                            if p_tx < 4:
                                for p_c in range(1):
                                    for p_i in T.unroll(2):
                                        for p_v in T.vectorized(4):
                                            a_r[p_i * 4 + p_v] = T.Cast("float32", a_s1[(p_tx // 4 * 2 + p_i) * 20 + (p_c * 4 + p_tx % 4) * 4 + p_v])
                                    for p_j in T.unroll(4):
                                        for p_v in T.vectorized(4):
                                            w_r[p_j * 4 + p_v] = T.Cast("float32", w_s1[p_j * 20 + (p_c * 4 + p_tx % 4) * 4 + p_v])
                                    for p_v in T.unroll(4):
                                        for p_i in T.unroll(2):
                                            for p_j in T.unroll(4):
                                                acc[p_i * 4 + p_j] = acc[p_i * 4 + p_j] + a_r[p_i * 4 + p_v] * w_r[p_j * 4 + p_v]
                            for p_i in T.unroll(2):
                                for p_j in T.unroll(4):
                                    part1[p_tx % 4 * 513 + (p_tx // 4 * 2 + p_i) * 4 + p_j] = acc[p_i * 4 + p_j]
                            T.tvm_storage_sync("shared", T.bool(False), -1)
                            for p_r in range(1):
                                if p_r * 256 + p_tx < 2:
                                    h_next[p_r * 256 + p_tx, p_bx] = T.call_extern("float32", "halstm_not_sentinel", T.sigmoid(x_s0[(p_r * 256 + p_tx) * 4 + 3] + bias_ih[p_bx + 48] + (part1[(p_r * 256 + p_tx) * 4 + 3] + part1[513 + (p_r * 256 + p_tx) * 4 + 3] + part1[1026 + (p_r * 256 + p_tx) * 4 + 3] + part1[1539 + (p_r * 256 + p_tx) * 4 + 3] + bias_hh[p_bx + 48])) * T.tanh(T.sigmoid(x_s0[(p_r * 256 + p_tx) * 4 + 1] + bias_ih[p_bx + 16] + (part1[(p_r * 256 + p_tx) * 4 + 1] + part1[513 + (p_r * 256 + p_tx) * 4 + 1] + part1[1026 + (p_r * 256 + p_tx) * 4 + 1] + part1[1539 + (p_r * 256 + p_tx) * 4 + 1] + bias_hh[p_bx + 16])) * c_t[p_r * 256 + p_tx, p_bx] + T.sigmoid(x_s0[(p_r * 256 + p_tx) * 4] + bias_ih[p_bx] + (part1[(p_r * 256 + p_tx) * 4] + part1[513 + (p_r * 256 + p_tx) * 4] + part1[1026 + (p_r * 256 + p_tx) * 4] + part1[1539 + (p_r * 256 + p_tx) * 4] + bias_hh[p_bx])) * T.tanh(x_s0[(p_r * 256 + p_tx) * 4 + 2] + bias_ih[p_bx + 32] + (part1[(p_r * 256 + p_tx) * 4 + 2] + part1[513 + (p_r * 256 + p_tx) * 4 + 2] + part1[1026 + (p_r * 256 + p_tx) * 4 + 2] + part1[1539 + (p_r * 256 + p_tx) * 4 + 2] + bias_hh[p_bx + 32]))))
                                    c_next[p_r * 256 + p_tx, p_bx] = T.sigmoid(x_s0[(p_r * 256 + p_tx) * 4 + 1] + bias_ih[p_bx + 16] + (part1[(p_r * 256 + p_tx) * 4 + 1] + part1[513 + (p_r * 256 + p_tx) * 4 + 1] + part1[1026 + (p_r * 256 + p_tx) * 4 + 1] + part1[1539 + (p_r * 256 + p_tx) * 4 + 1] + bias_hh[p_bx + 16])) * c_t[p_r * 256 + p_tx, p_bx] + T.sigmoid(x_s0[(p_r * 256 + p_tx) * 4] + bias_ih[p_bx] + (part1[(p_r * 256 + p_tx) * 4] + part1[513 + (p_r * 256 + p_tx) * 4] + part1[1026 + (p_r * 256 + p_tx) * 4] + part1[1539 + (p_r * 256 + p_tx) * 4] + bias_hh[p_bx])) * T.tanh(x_s0[(p_r * 256 + p_tx) * 4 + 2] + bias_ih[p_bx + 32] + (part1[(p_r * 256 + p_tx) * 4 + 2] + part1[513 + (p_r * 256 + p_tx) * 4 + 2] + part1[1026 + (p_r * 256 + p_tx) * 4 + 2] + part1[1539 + (p_r * 256 + p_tx) * 4 + 2] + bias_hh[p_bx + 32]))
                            T.tvm_storage_sync("shared", T.bool(False), -1)
