# from tvm.script import ir as I
# from tvm.script import tirx as T
# from tvm.tirx.layout import Axis

@I.ir_module
class Module:
    @T.prim_func(s_tir=True)
    def main(x: T.Buffer((48, 8), "float16"), h0: T.Buffer((16, 16), "float16"), c0: T.Buffer((16, 16), "float16"), weight_ih: T.Buffer((64, 8), "float16"), weight_hh: T.Buffer((64, 16), "float16"), bias_ih: T.Buffer((64,), "float16"), bias_hh: T.Buffer((64,), "float16"), h_seq: T.Buffer((64, 16), "float16"), c_seq: T.Buffer((64, 16), "float16")):
        T.func_attr({"tirx.noalias": True})
        # with T.sblock("root"):
        x_proj0 = T.alloc_buffer((48, 64))
        w_packed1 = T.alloc_buffer((16, 64), "float16")
        with T.sblock("prologue"):
            T.reads(x[0:48, 0:8], weight_ih[0:64, 0:8], weight_hh[0:64, 0:16], h0[0:16, 0:16], c0[0:16, 0:16])
            T.writes(x_proj0[0:48, 0:64], w_packed1[0:16, 0:64], h_seq[0:16, 0:16], c_seq[0:16, 0:16])
            w_packed0 = T.sblock_alloc_buffer((8, 64), "float16")
            x_pad_shared_dyn = T.sblock_alloc_buffer((64, 32), "float16", scope="shared.dyn")
            w_packed0_pad_shared_dyn = T.sblock_alloc_buffer((32, 64), "float16", scope="shared.dyn")
            x_pad_shared_dyn_wmma_matrix_a = T.sblock_alloc_buffer((64, 32), "float16", scope="wmma.matrix_a")
            w_packed0_pad_shared_dyn_wmma_matrix_b = T.sblock_alloc_buffer((32, 64), "float16", scope="wmma.matrix_b")
            x_proj0_pad_shared_dyn = T.sblock_alloc_buffer((64, 64), scope="shared.dyn")
            x_proj0_pad_shared_dyn_wmma_accumulator = T.sblock_alloc_buffer((64, 64), scope="wmma.accumulator")
            w_packed0_shared = T.sblock_alloc_buffer((8, 64), "float16", scope="shared")
            w_packed1_shared = T.sblock_alloc_buffer((16, 64), "float16", scope="shared")
            h_init = T.match_buffer(h_seq[0:16, 0:16], (16, 16), "float16", offset_factor=1)
            c_init = T.match_buffer(c_seq[0:16, 0:16], (16, 16), "float16", offset_factor=1)
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
                            w_packed0_shared[v_i0, v_i1] = T.if_then_else(v_i1 < 64, weight_ih[v_i1, v_i0], T.float16(0.0))
                for ax0_ax1_fused_0 in range(1):
                    for ax0_ax1_fused_1 in T.thread_binding(256, thread="threadIdx.x"):
                        with T.sblock("w_packed0_shared"):
                            v0 = T.axis.spatial(8, (ax0_ax1_fused_0 * 256 + ax0_ax1_fused_1) // 32)
                            v1 = T.axis.spatial(64, i0_0_i1_0_fused * 32 + (ax0_ax1_fused_0 * 256 + ax0_ax1_fused_1) % 32)
                            T.reads(w_packed0_shared[v0, v1])
                            T.writes(w_packed0[v0, v1])
                            w_packed0[v0, v1] = w_packed0_shared[v0, v1]
            for b_0_0_n_0_0_fused in T.thread_binding(1, thread="blockIdx.x"):
                for b_0_1_n_0_1_fused in T.thread_binding(4, thread="threadIdx.y"):
                    for b_0_2_init, n_0_2_init in T.grid(2, 2):
                        with T.sblock("x_proj0_o_init"):
                            v_b_o = T.axis.spatial(4, b_0_1_n_0_1_fused // 2 * 2 + b_0_2_init)
                            v_n_o = T.axis.spatial(4, b_0_1_n_0_1_fused % 2 * 2 + n_0_2_init)
                            T.reads()
                            T.writes(x_proj0_pad_shared_dyn_wmma_accumulator[v_b_o * 16:v_b_o * 16 + 16, v_n_o * 16:v_n_o * 16 + 16])
                            with T.sblock("x_proj0_init_o"):
                                v_b_i_init_o = T.axis.spatial(1, 0)
                                v_n_i_init_o = T.axis.spatial(1, 0)
                                T.reads()
                                T.writes(x_proj0_pad_shared_dyn_wmma_accumulator[v_b_o * 16:v_b_o * 16 + 16, v_n_o * 16:v_n_o * 16 + 16])
                                C = T.match_buffer(x_proj0_pad_shared_dyn_wmma_accumulator[v_b_o * 16:v_b_o * 16 + 16, v_n_o * 16:v_n_o * 16 + 16], (16, 16), strides=("d1", "d0"), scope="wmma.accumulator", offset_factor=16)
                                T.tvm_fill_fragment(C.data, 16, 16, 16, C.elem_offset // C.strides[0] // 16 * (C.strides[0] // 16) + C.elem_offset % C.strides[0] // 16, T.float32(0.0))
                    for k_0_0 in range(1):
                        for ax0_ax1_fused_0 in range(16):
                            for ax0_ax1_fused_1 in T.thread_binding(4, thread="threadIdx.y"):
                                for ax0_ax1_fused_2 in T.thread_binding(32, thread="threadIdx.x"):
                                    for ax0_ax1_fused_3 in T.vectorized(1):
                                        with T.sblock("x_pad_shared.dyn"):
                                            v0 = T.axis.spatial(64, (ax0_ax1_fused_0 * 128 + ax0_ax1_fused_1 * 32 + ax0_ax1_fused_2 + ax0_ax1_fused_3) // 32)
                                            v1 = T.axis.spatial(32, (ax0_ax1_fused_0 * 128 + ax0_ax1_fused_1 * 32 + ax0_ax1_fused_2 + ax0_ax1_fused_3) % 32)
                                            T.reads(x[v0, v1])
                                            T.writes(x_pad_shared_dyn[v0, v1])
                                            T.sblock_attr({"buffer_dim_align": [[0, 0, 32, 8]]})
                                            x_pad_shared_dyn[v0, v1] = T.if_then_else(v0 < 48 and v1 < 8, x[v0, v1], T.float16(0.0))
                        for ax0_ax1_fused_0 in range(16):
                            for ax0_ax1_fused_1 in T.thread_binding(4, thread="threadIdx.y"):
                                for ax0_ax1_fused_2 in T.thread_binding(32, thread="threadIdx.x"):
                                    for ax0_ax1_fused_3 in T.vectorized(1):
                                        with T.sblock("w_packed0_pad_shared.dyn"):
                                            v0 = T.axis.spatial(32, (ax0_ax1_fused_0 * 128 + ax0_ax1_fused_1 * 32 + ax0_ax1_fused_2 + ax0_ax1_fused_3) // 64)
                                            v1 = T.axis.spatial(64, (ax0_ax1_fused_0 * 128 + ax0_ax1_fused_1 * 32 + ax0_ax1_fused_2 + ax0_ax1_fused_3) % 64)
                                            T.reads(w_packed0[v0, v1])
                                            T.writes(w_packed0_pad_shared_dyn[v0, v1])
                                            T.sblock_attr({"buffer_dim_align": [[0, 0, 32, 8]]})
                                            w_packed0_pad_shared_dyn[v0, v1] = T.if_then_else(v0 < 8, w_packed0[v0, v1], T.float16(0.0))
                        for k_0_1 in range(2):
                            for ax0_0, ax1_0 in T.grid(2, 1):
                                with T.sblock("x_pad_shared.dyn_wmma.matrix_a_o"):
                                    v0_o = T.axis.spatial(4, b_0_1_n_0_1_fused // 2 * 2 + ax0_0)
                                    v1_o = T.axis.spatial(2, k_0_1 + ax1_0)
                                    T.reads(x_pad_shared_dyn[v0_o * 16:v0_o * 16 + 16, v1_o * 16:v1_o * 16 + 16])
                                    T.writes(x_pad_shared_dyn_wmma_matrix_a[v0_o * 16:v0_o * 16 + 16, v1_o * 16:v1_o * 16 + 16])
                                    A = T.match_buffer(x_pad_shared_dyn[v0_o * 16:v0_o * 16 + 16, v1_o * 16:v1_o * 16 + 16], (16, 16), "float16", strides=("s1", "s0"), scope="shared.dyn", offset_factor=16)
                                    C = T.match_buffer(x_pad_shared_dyn_wmma_matrix_a[v0_o * 16:v0_o * 16 + 16, v1_o * 16:v1_o * 16 + 16], (16, 16), "float16", strides=("d1", "d0"), scope="wmma.matrix_a", offset_factor=16)
                                    T.tvm_load_matrix_sync(C.data, 16, 16, 16, C.elem_offset // C.strides[0] // 16 * (C.strides[0] // 16) + C.elem_offset % C.strides[0] // 16, T.tvm_access_ptr(T.type_annotation("float16"), A.data, A.elem_offset, A.strides[0] * 16, 1), A.strides[0], "row_major")
                            for ax0_0, ax1_0 in T.grid(1, 2):
                                with T.sblock("w_packed0_pad_shared.dyn_wmma.matrix_b_o"):
                                    v0_o = T.axis.spatial(2, k_0_1 + ax0_0)
                                    v1_o = T.axis.spatial(4, b_0_1_n_0_1_fused % 2 * 2 + ax1_0)
                                    T.reads(w_packed0_pad_shared_dyn[v0_o * 16:v0_o * 16 + 16, v1_o * 16:v1_o * 16 + 16])
                                    T.writes(w_packed0_pad_shared_dyn_wmma_matrix_b[v0_o * 16:v0_o * 16 + 16, v1_o * 16:v1_o * 16 + 16])
                                    A = T.match_buffer(w_packed0_pad_shared_dyn[v0_o * 16:v0_o * 16 + 16, v1_o * 16:v1_o * 16 + 16], (16, 16), "float16", strides=("s1", "s0"), scope="shared.dyn", offset_factor=16)
                                    C = T.match_buffer(w_packed0_pad_shared_dyn_wmma_matrix_b[v0_o * 16:v0_o * 16 + 16, v1_o * 16:v1_o * 16 + 16], (16, 16), "float16", strides=("d1", "d0"), scope="wmma.matrix_b", offset_factor=16)
                                    T.tvm_load_matrix_sync(C.data, 16, 16, 16, C.elem_offset // C.strides[0] // 16 * (C.strides[0] // 16) + C.elem_offset % C.strides[0] // 16, T.tvm_access_ptr(T.type_annotation("float16"), A.data, A.elem_offset, A.strides[0] * 16, 1), A.strides[0], "row_major")
                            for b_0_2, n_0_2 in T.grid(2, 2):
                                with T.sblock("x_proj0_o_update"):
                                    v_b_o = T.axis.spatial(4, b_0_1_n_0_1_fused // 2 * 2 + b_0_2)
                                    v_n_o = T.axis.spatial(4, b_0_1_n_0_1_fused % 2 * 2 + n_0_2)
                                    v_k_o = T.axis.reduce(2, k_0_0 * 2 + k_0_1)
                                    T.reads(x_proj0_pad_shared_dyn_wmma_accumulator[v_b_o * 16:v_b_o * 16 + 16, v_n_o * 16:v_n_o * 16 + 16], x_pad_shared_dyn_wmma_matrix_a[v_b_o * 16:v_b_o * 16 + 16, v_k_o * 16:v_k_o * 16 + 16], w_packed0_pad_shared_dyn_wmma_matrix_b[v_k_o * 16:v_k_o * 16 + 16, v_n_o * 16:v_n_o * 16 + 16])
                                    T.writes(x_proj0_pad_shared_dyn_wmma_accumulator[v_b_o * 16:v_b_o * 16 + 16, v_n_o * 16:v_n_o * 16 + 16])
                                    with T.sblock("x_proj0_o"):
                                        v_b_i_o = T.axis.spatial(1, 0)
                                        v_n_i_o = T.axis.spatial(1, 0)
                                        v_k_i_o = T.axis.reduce(1, 0)
                                        T.reads(x_proj0_pad_shared_dyn_wmma_accumulator[v_b_o * 16:v_b_o * 16 + 16, v_n_o * 16:v_n_o * 16 + 16], x_pad_shared_dyn_wmma_matrix_a[v_b_o * 16:v_b_o * 16 + 16, v_k_o * 16:v_k_o * 16 + 16], w_packed0_pad_shared_dyn_wmma_matrix_b[v_k_o * 16:v_k_o * 16 + 16, v_n_o * 16:v_n_o * 16 + 16])
                                        T.writes(x_proj0_pad_shared_dyn_wmma_accumulator[v_b_o * 16:v_b_o * 16 + 16, v_n_o * 16:v_n_o * 16 + 16])
                                        A = T.match_buffer(x_pad_shared_dyn_wmma_matrix_a[v_b_o * 16:v_b_o * 16 + 16, v_k_o * 16:v_k_o * 16 + 16], (16, 16), "float16", strides=("a1", "a0"), scope="wmma.matrix_a", offset_factor=16)
                                        B = T.match_buffer(w_packed0_pad_shared_dyn_wmma_matrix_b[v_k_o * 16:v_k_o * 16 + 16, v_n_o * 16:v_n_o * 16 + 16], (16, 16), "float16", strides=("b1", "b0"), scope="wmma.matrix_b", offset_factor=16)
                                        C = T.match_buffer(x_proj0_pad_shared_dyn_wmma_accumulator[v_b_o * 16:v_b_o * 16 + 16, v_n_o * 16:v_n_o * 16 + 16], (16, 16), strides=("c1", "c0"), scope="wmma.accumulator", offset_factor=16)
                                        T.tvm_mma_sync(C.data, C.elem_offset // C.strides[0] // 16 * (C.strides[0] // 16) + C.elem_offset % C.strides[0] // 16, A.data, A.elem_offset // A.strides[0] // 16 * (A.strides[0] // 16) + A.elem_offset % A.strides[0] // 16, B.data, B.elem_offset // B.strides[0] // 16 * (B.strides[0] // 16) + B.elem_offset % B.strides[0] // 16, C.data, C.elem_offset // C.strides[0] // 16 * (C.strides[0] // 16) + C.elem_offset % C.strides[0] // 16)
                    for ax0_0, ax1_0 in T.grid(2, 2):
                        with T.sblock("x_proj0_pad_shared.dyn_wmma.accumulator_o"):
                            v0_o = T.axis.spatial(4, b_0_1_n_0_1_fused // 2 * 2 + ax0_0)
                            v1_o = T.axis.spatial(4, b_0_1_n_0_1_fused % 2 * 2 + ax1_0)
                            T.reads(x_proj0_pad_shared_dyn_wmma_accumulator[v0_o * 16:v0_o * 16 + 16, v1_o * 16:v1_o * 16 + 16])
                            T.writes(x_proj0_pad_shared_dyn[v0_o * 16:v0_o * 16 + 16, v1_o * 16:v1_o * 16 + 16])
                            A = T.match_buffer(x_proj0_pad_shared_dyn_wmma_accumulator[v0_o * 16:v0_o * 16 + 16, v1_o * 16:v1_o * 16 + 16], (16, 16), strides=("d1", "d0"), scope="wmma.accumulator", offset_factor=16)
                            C = T.match_buffer(x_proj0_pad_shared_dyn[v0_o * 16:v0_o * 16 + 16, v1_o * 16:v1_o * 16 + 16], (16, 16), strides=("s1", "s0"), scope="shared.dyn", offset_factor=16)
                            T.tvm_store_matrix_sync(A.data, 16, 16, 16, A.elem_offset // A.strides[0] // 16 * (A.strides[0] // 16) + A.elem_offset % A.strides[0] // 16, T.tvm_access_ptr(T.type_annotation("float32"), C.data, C.elem_offset, C.strides[0] * 16, 2), C.strides[0], "row_major")
                    for ax0_ax1_fused_0 in range(32):
                        for ax0_ax1_fused_1 in T.thread_binding(32, thread="threadIdx.x"):
                            with T.sblock("x_proj0_pad_shared.dyn"):
                                v0 = T.axis.spatial(64, b_0_1_n_0_1_fused // 2 * 32 + (ax0_ax1_fused_0 * 32 + ax0_ax1_fused_1) // 32)
                                v1 = T.axis.spatial(64, b_0_1_n_0_1_fused % 2 * 32 + (ax0_ax1_fused_0 * 32 + ax0_ax1_fused_1) % 32)
                                T.where(b_0_1_n_0_1_fused // 2 * 32 + (ax0_ax1_fused_0 * 32 + ax0_ax1_fused_1) // 32 < 48)
                                T.reads(x_proj0_pad_shared_dyn[v0, v1])
                                T.writes(x_proj0[v0, v1])
                                x_proj0[v0, v1] = x_proj0_pad_shared_dyn[v0, v1]
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
                            w_packed1_shared[v_i0, v_i1] = T.if_then_else(v_i1 < 64, weight_hh[v_i1, v_i0], T.float16(0.0))
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
                    for i1_m_1 in T.vectorized(8):
                        with T.sblock("h_init"):
                            v_i0 = T.axis.spatial(16, (i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1) // 2)
                            v_i1 = T.axis.spatial(16, (i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1) % 2 * 8 + i1_m_1)
                            T.where(i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1 < 32)
                            T.reads(h0[v_i0, v_i1])
                            T.writes(h_init[v_i0, v_i1])
                            h_init[v_i0, v_i1] = h0[v_i0, v_i1]
                        with T.sblock("c_init"):
                            v_i0 = T.axis.spatial(16, (i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1) // 2)
                            v_i1 = T.axis.spatial(16, (i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1) % 2 * 8 + i1_m_1)
                            T.where(i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1 < 32)
                            T.reads(c0[v_i0, v_i1])
                            T.writes(c_init[v_i0, v_i1])
                            c_init[v_i0, v_i1] = c0[v_i0, v_i1]
        for t in range(3):
            with T.sblock("step"):
                T.reads(x_proj0[t * 16:t * 16 + 16, 0:64], bias_ih[0:64], h_seq[t * 16:t * 16 + 16, 0:16], w_packed1[0:16, 0:64], bias_hh[0:64], c_seq[t * 16:t * 16 + 16, 0:16])
                T.writes(h_seq[t * 16 + 16:t * 16 + 16 + 16, 0:16], c_seq[t * 16 + 16:t * 16 + 16 + 16, 0:16])
                gemm0 = T.sblock_alloc_buffer((16, 64))
                gemm0_operand_pad_shared_dyn = T.sblock_alloc_buffer((16, 32), "float16", scope="shared.dyn")
                w_packed1_pad_shared_dyn = T.sblock_alloc_buffer((32, 64), "float16", scope="shared.dyn")
                gemm0_operand_pad_shared_dyn_wmma_matrix_a = T.sblock_alloc_buffer((16, 32), "float16", scope="wmma.matrix_a")
                w_packed1_pad_shared_dyn_wmma_matrix_b = T.sblock_alloc_buffer((32, 64), "float16", scope="wmma.matrix_b")
                gemm0_shared_dyn = T.sblock_alloc_buffer((16, 64), scope="shared.dyn")
                gemm0_shared_dyn_wmma_accumulator = T.sblock_alloc_buffer((16, 64), scope="wmma.accumulator")
                x_proj0_t = T.match_buffer(x_proj0[t * 16:t * 16 + 16, 0:64], (16, 64), offset_factor=1)
                h_t = T.match_buffer(h_seq[t * 16:t * 16 + 16, 0:16], (16, 16), "float16", offset_factor=1)
                c_t = T.match_buffer(c_seq[t * 16:t * 16 + 16, 0:16], (16, 16), "float16", offset_factor=1)
                h_next = T.match_buffer(h_seq[t * 16 + 16:t * 16 + 16 + 16, 0:16], (16, 16), "float16", offset_factor=1)
                c_next = T.match_buffer(c_seq[t * 16 + 16:t * 16 + 16 + 16, 0:16], (16, 16), "float16", offset_factor=1)
                for b_0_0_n_0_0_fused in T.thread_binding(4, thread="blockIdx.x"):
                    for b_0_1_n_0_1_fused in T.thread_binding(1, thread="threadIdx.y"):
                        for b_0_2_init, n_0_2_init in T.grid(1, 1):
                            with T.sblock("gemm0_o_init"):
                                v_b_o = T.axis.spatial(1, b_0_2_init)
                                v_n_o = T.axis.spatial(4, b_0_0_n_0_0_fused + n_0_2_init)
                                T.reads()
                                T.writes(gemm0_shared_dyn_wmma_accumulator[0:16, v_n_o * 16:v_n_o * 16 + 16])
                                with T.sblock("gemm0_init_o"):
                                    v_b_i_init_o = T.axis.spatial(1, 0)
                                    v_n_i_init_o = T.axis.spatial(1, 0)
                                    T.reads()
                                    T.writes(gemm0_shared_dyn_wmma_accumulator[0:16, v_n_o * 16:v_n_o * 16 + 16])
                                    C = T.match_buffer(gemm0_shared_dyn_wmma_accumulator[0:16, v_n_o * 16:v_n_o * 16 + 16], (16, 16), strides=("d1", "d0"), scope="wmma.accumulator", offset_factor=16)
                                    T.tvm_fill_fragment(C.data, 16, 16, 16, C.elem_offset // C.strides[0] // 16 * (C.strides[0] // 16) + C.elem_offset % C.strides[0] // 16, T.float32(0.0))
                        for k_0_0 in range(1):
                            for ax0_ax1_fused_0 in range(16):
                                for ax0_ax1_fused_1 in T.thread_binding(1, thread="threadIdx.y"):
                                    for ax0_ax1_fused_2 in T.thread_binding(32, thread="threadIdx.x"):
                                        for ax0_ax1_fused_3 in T.vectorized(1):
                                            with T.sblock("gemm0_operand_pad_shared.dyn"):
                                                v0 = T.axis.spatial(16, (ax0_ax1_fused_0 * 32 + ax0_ax1_fused_1 * 32 + ax0_ax1_fused_2 + ax0_ax1_fused_3) // 32)
                                                v1 = T.axis.spatial(32, (ax0_ax1_fused_0 * 32 + ax0_ax1_fused_1 * 32 + ax0_ax1_fused_2 + ax0_ax1_fused_3) % 32)
                                                T.reads(h_t[v0, v1])
                                                T.writes(gemm0_operand_pad_shared_dyn[v0, v1])
                                                T.sblock_attr({"buffer_dim_align": [[0, 0, 32, 8]]})
                                                gemm0_operand_pad_shared_dyn[v0, v1] = T.if_then_else(v1 < 16, h_t[v0, v1], T.float16(0.0))
                            for ax0_ax1_fused_0 in range(16):
                                for ax0_ax1_fused_1 in T.thread_binding(1, thread="threadIdx.y"):
                                    for ax0_ax1_fused_2 in T.thread_binding(32, thread="threadIdx.x"):
                                        for ax0_ax1_fused_3 in T.vectorized(1):
                                            with T.sblock("w_packed1_pad_shared.dyn"):
                                                v0 = T.axis.spatial(32, (ax0_ax1_fused_0 * 32 + ax0_ax1_fused_1 * 32 + ax0_ax1_fused_2 + ax0_ax1_fused_3) // 16)
                                                v1 = T.axis.spatial(64, b_0_0_n_0_0_fused * 16 + (ax0_ax1_fused_0 * 32 + ax0_ax1_fused_1 * 32 + ax0_ax1_fused_2 + ax0_ax1_fused_3) % 16)
                                                T.reads(w_packed1[v0, v1])
                                                T.writes(w_packed1_pad_shared_dyn[v0, v1])
                                                T.sblock_attr({"buffer_dim_align": [[0, 0, 32, 8]]})
                                                w_packed1_pad_shared_dyn[v0, v1] = T.if_then_else(v0 < 16, w_packed1[v0, v1], T.float16(0.0))
                            for k_0_1 in range(2):
                                for ax0_0, ax1_0 in T.grid(1, 1):
                                    with T.sblock("gemm0_operand_pad_shared.dyn_wmma.matrix_a_o"):
                                        v0_o = T.axis.spatial(1, ax0_0)
                                        v1_o = T.axis.spatial(2, k_0_1 + ax1_0)
                                        T.reads(gemm0_operand_pad_shared_dyn[0:16, v1_o * 16:v1_o * 16 + 16])
                                        T.writes(gemm0_operand_pad_shared_dyn_wmma_matrix_a[0:16, v1_o * 16:v1_o * 16 + 16])
                                        A = T.match_buffer(gemm0_operand_pad_shared_dyn[0:16, v1_o * 16:v1_o * 16 + 16], (16, 16), "float16", strides=("s1", "s0"), scope="shared.dyn", offset_factor=16)
                                        C = T.match_buffer(gemm0_operand_pad_shared_dyn_wmma_matrix_a[0:16, v1_o * 16:v1_o * 16 + 16], (16, 16), "float16", strides=("d1", "d0"), scope="wmma.matrix_a", offset_factor=16)
                                        T.tvm_load_matrix_sync(C.data, 16, 16, 16, C.elem_offset // C.strides[0] // 16 * (C.strides[0] // 16) + C.elem_offset % C.strides[0] // 16, T.tvm_access_ptr(T.type_annotation("float16"), A.data, A.elem_offset, A.strides[0] * 16, 1), A.strides[0], "row_major")
                                for ax0_0, ax1_0 in T.grid(1, 1):
                                    with T.sblock("w_packed1_pad_shared.dyn_wmma.matrix_b_o"):
                                        v0_o = T.axis.spatial(2, k_0_1 + ax0_0)
                                        v1_o = T.axis.spatial(4, b_0_0_n_0_0_fused + ax1_0)
                                        T.reads(w_packed1_pad_shared_dyn[v0_o * 16:v0_o * 16 + 16, v1_o * 16:v1_o * 16 + 16])
                                        T.writes(w_packed1_pad_shared_dyn_wmma_matrix_b[v0_o * 16:v0_o * 16 + 16, v1_o * 16:v1_o * 16 + 16])
                                        A = T.match_buffer(w_packed1_pad_shared_dyn[v0_o * 16:v0_o * 16 + 16, v1_o * 16:v1_o * 16 + 16], (16, 16), "float16", strides=("s1", "s0"), scope="shared.dyn", offset_factor=16)
                                        C = T.match_buffer(w_packed1_pad_shared_dyn_wmma_matrix_b[v0_o * 16:v0_o * 16 + 16, v1_o * 16:v1_o * 16 + 16], (16, 16), "float16", strides=("d1", "d0"), scope="wmma.matrix_b", offset_factor=16)
                                        T.tvm_load_matrix_sync(C.data, 16, 16, 16, C.elem_offset // C.strides[0] // 16 * (C.strides[0] // 16) + C.elem_offset % C.strides[0] // 16, T.tvm_access_ptr(T.type_annotation("float16"), A.data, A.elem_offset, A.strides[0] * 16, 1), A.strides[0], "row_major")
                                for b_0_2, n_0_2 in T.grid(1, 1):
                                    with T.sblock("gemm0_o_update"):
                                        v_b_o = T.axis.spatial(1, b_0_2)
                                        v_n_o = T.axis.spatial(4, b_0_0_n_0_0_fused + n_0_2)
                                        v_k_o = T.axis.reduce(2, k_0_0 * 2 + k_0_1)
                                        T.reads(gemm0_shared_dyn_wmma_accumulator[0:16, v_n_o * 16:v_n_o * 16 + 16], gemm0_operand_pad_shared_dyn_wmma_matrix_a[0:16, v_k_o * 16:v_k_o * 16 + 16], w_packed1_pad_shared_dyn_wmma_matrix_b[v_k_o * 16:v_k_o * 16 + 16, v_n_o * 16:v_n_o * 16 + 16])
                                        T.writes(gemm0_shared_dyn_wmma_accumulator[0:16, v_n_o * 16:v_n_o * 16 + 16])
                                        with T.sblock("gemm0_o"):
                                            v_b_i_o = T.axis.spatial(1, 0)
                                            v_n_i_o = T.axis.spatial(1, 0)
                                            v_k_i_o = T.axis.reduce(1, 0)
                                            T.reads(gemm0_shared_dyn_wmma_accumulator[0:16, v_n_o * 16:v_n_o * 16 + 16], gemm0_operand_pad_shared_dyn_wmma_matrix_a[0:16, v_k_o * 16:v_k_o * 16 + 16], w_packed1_pad_shared_dyn_wmma_matrix_b[v_k_o * 16:v_k_o * 16 + 16, v_n_o * 16:v_n_o * 16 + 16])
                                            T.writes(gemm0_shared_dyn_wmma_accumulator[0:16, v_n_o * 16:v_n_o * 16 + 16])
                                            A = T.match_buffer(gemm0_operand_pad_shared_dyn_wmma_matrix_a[0:16, v_k_o * 16:v_k_o * 16 + 16], (16, 16), "float16", strides=("a1", "a0"), scope="wmma.matrix_a", offset_factor=16)
                                            B = T.match_buffer(w_packed1_pad_shared_dyn_wmma_matrix_b[v_k_o * 16:v_k_o * 16 + 16, v_n_o * 16:v_n_o * 16 + 16], (16, 16), "float16", strides=("b1", "b0"), scope="wmma.matrix_b", offset_factor=16)
                                            C = T.match_buffer(gemm0_shared_dyn_wmma_accumulator[0:16, v_n_o * 16:v_n_o * 16 + 16], (16, 16), strides=("c1", "c0"), scope="wmma.accumulator", offset_factor=16)
                                            T.tvm_mma_sync(C.data, C.elem_offset // C.strides[0] // 16 * (C.strides[0] // 16) + C.elem_offset % C.strides[0] // 16, A.data, A.elem_offset // A.strides[0] // 16 * (A.strides[0] // 16) + A.elem_offset % A.strides[0] // 16, B.data, B.elem_offset // B.strides[0] // 16 * (B.strides[0] // 16) + B.elem_offset % B.strides[0] // 16, C.data, C.elem_offset // C.strides[0] // 16 * (C.strides[0] // 16) + C.elem_offset % C.strides[0] // 16)
                        for ax0_0, ax1_0 in T.grid(1, 1):
                            with T.sblock("gemm0_shared.dyn_wmma.accumulator_o"):
                                v0_o = T.axis.spatial(1, ax0_0)
                                v1_o = T.axis.spatial(4, b_0_0_n_0_0_fused + ax1_0)
                                T.reads(gemm0_shared_dyn_wmma_accumulator[0:16, v1_o * 16:v1_o * 16 + 16])
                                T.writes(gemm0_shared_dyn[0:16, v1_o * 16:v1_o * 16 + 16])
                                A = T.match_buffer(gemm0_shared_dyn_wmma_accumulator[0:16, v1_o * 16:v1_o * 16 + 16], (16, 16), strides=("d1", "d0"), scope="wmma.accumulator", offset_factor=16)
                                C = T.match_buffer(gemm0_shared_dyn[0:16, v1_o * 16:v1_o * 16 + 16], (16, 16), strides=("s1", "s0"), scope="shared.dyn", offset_factor=16)
                                T.tvm_store_matrix_sync(A.data, 16, 16, 16, A.elem_offset // A.strides[0] // 16 * (A.strides[0] // 16) + A.elem_offset % A.strides[0] // 16, T.tvm_access_ptr(T.type_annotation("float32"), C.data, C.elem_offset, C.strides[0] * 16, 2), C.strides[0], "row_major")
                        for ax0_ax1_fused_0 in range(8):
                            for ax0_ax1_fused_1 in T.thread_binding(32, thread="threadIdx.x"):
                                with T.sblock("gemm0_shared.dyn"):
                                    v0 = T.axis.spatial(16, (ax0_ax1_fused_0 * 32 + ax0_ax1_fused_1) // 16)
                                    v1 = T.axis.spatial(64, b_0_0_n_0_0_fused * 16 + (ax0_ax1_fused_0 * 32 + ax0_ax1_fused_1) % 16)
                                    T.reads(gemm0_shared_dyn[v0, v1])
                                    T.writes(gemm0[v0, v1])
                                    gemm0[v0, v1] = gemm0_shared_dyn[v0, v1]
                for i0_m_i1_m_0_fused_0 in T.thread_binding(1, thread="blockIdx.x"):
                    for i0_m_i1_m_0_fused_1 in T.thread_binding(256, thread="threadIdx.x"):
                        for i1_m_1 in T.vectorized(4):
                            with T.sblock("h_next"):
                                v_i0 = T.axis.spatial(16, (i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1) // 4)
                                v_i1 = T.axis.spatial(16, (i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1) % 4 * 4 + i1_m_1)
                                T.where(i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1 < 64)
                                T.reads(x_proj0_t[v_i0, v_i1:v_i1 + 49], bias_ih[v_i1:v_i1 + 49], gemm0[v_i0, v_i1:v_i1 + 49], bias_hh[v_i1:v_i1 + 49], c_t[v_i0, v_i1])
                                T.writes(h_next[v_i0, v_i1])
                                h_next[v_i0, v_i1] = T.Cast("float16", T.sigmoid(x_proj0_t[v_i0, v_i1 + 48] + T.Cast("float32", bias_ih[v_i1 + 48]) + (gemm0[v_i0, v_i1 + 48] + T.Cast("float32", bias_hh[v_i1 + 48]))) * T.tanh(T.sigmoid(x_proj0_t[v_i0, v_i1 + 16] + T.Cast("float32", bias_ih[v_i1 + 16]) + (gemm0[v_i0, v_i1 + 16] + T.Cast("float32", bias_hh[v_i1 + 16]))) * T.Cast("float32", c_t[v_i0, v_i1]) + T.sigmoid(x_proj0_t[v_i0, v_i1] + T.Cast("float32", bias_ih[v_i1]) + (gemm0[v_i0, v_i1] + T.Cast("float32", bias_hh[v_i1]))) * T.tanh(x_proj0_t[v_i0, v_i1 + 32] + T.Cast("float32", bias_ih[v_i1 + 32]) + (gemm0[v_i0, v_i1 + 32] + T.Cast("float32", bias_hh[v_i1 + 32])))))
                            with T.sblock("c_next"):
                                v_i0 = T.axis.spatial(16, (i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1) // 4)
                                v_i1 = T.axis.spatial(16, (i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1) % 4 * 4 + i1_m_1)
                                T.where(i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1 < 64)
                                T.reads(x_proj0_t[v_i0, v_i1:v_i1 + 33], bias_ih[v_i1:v_i1 + 33], gemm0[v_i0, v_i1:v_i1 + 33], bias_hh[v_i1:v_i1 + 33], c_t[v_i0, v_i1])
                                T.writes(c_next[v_i0, v_i1])
                                c_next[v_i0, v_i1] = T.Cast("float16", T.sigmoid(x_proj0_t[v_i0, v_i1 + 16] + T.Cast("float32", bias_ih[v_i1 + 16]) + (gemm0[v_i0, v_i1 + 16] + T.Cast("float32", bias_hh[v_i1 + 16]))) * T.Cast("float32", c_t[v_i0, v_i1]) + T.sigmoid(x_proj0_t[v_i0, v_i1] + T.Cast("float32", bias_ih[v_i1]) + (gemm0[v_i0, v_i1] + T.Cast("float32", bias_hh[v_i1]))) * T.tanh(x_proj0_t[v_i0, v_i1 + 32] + T.Cast("float32", bias_ih[v_i1 + 32]) + (gemm0[v_i0, v_i1 + 32] + T.Cast("float32", bias_hh[v_i1 + 32]))))
