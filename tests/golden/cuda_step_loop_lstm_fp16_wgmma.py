# from tvm.script import ir as I
# from tvm.script import tirx as T
# from tvm.tirx.layout import Axis

@I.ir_module
class Module:
    @T.prim_func(s_tir=True)
    def main(x: T.Buffer((48, 64), "float16"), h0: T.Buffer((16, 64), "float16"), c0: T.Buffer((16, 64), "float16"), weight_ih: T.Buffer((256, 64), "float16"), weight_hh: T.Buffer((256, 64), "float16"), bias_ih: T.Buffer((256,), "float16"), bias_hh: T.Buffer((256,), "float16"), h_seq: T.Buffer((64, 64), "float16"), c_seq: T.Buffer((64, 64), "float16")):
        T.func_attr({"tirx.noalias": True})
        # with T.sblock("root"):
        x_proj0 = T.alloc_buffer((48, 256))
        w_packed1 = T.alloc_buffer((256, 64), "float16")
        with T.sblock("prologue"):
            T.reads(x[0:48, 0:64], weight_ih[0:256, 0:64], weight_hh[0:256, 0:64], h0[0:16, 0:64], c0[0:16, 0:64])
            T.writes(x_proj0[0:48, 0:256], w_packed1[0:256, 0:64], h_seq[0:16, 0:64], c_seq[0:16, 0:64])
            w_packed0 = T.sblock_alloc_buffer((256, 64), "float16")
            h_init = T.match_buffer(h_seq[0:16, 0:64], (16, 64), "float16", offset_factor=1)
            c_init = T.match_buffer(c_seq[0:16, 0:64], (16, 64), "float16", offset_factor=1)
            for i0_i1_0_fused_0 in T.thread_binding(8, thread="blockIdx.x"):
                for i0_i1_0_fused_1 in T.thread_binding(256, thread="threadIdx.x"):
                    for i1_1 in T.vectorized(8):
                        with T.sblock("w_packed0"):
                            v_i0 = T.axis.spatial(256, (i0_i1_0_fused_0 * 256 + i0_i1_0_fused_1) // 8)
                            v_i1 = T.axis.spatial(64, (i0_i1_0_fused_0 * 256 + i0_i1_0_fused_1) % 8 * 8 + i1_1)
                            T.reads(weight_ih[v_i0, v_i1])
                            T.writes(w_packed0[v_i0, v_i1])
                            w_packed0[v_i0, v_i1] = T.if_then_else(v_i0 < 256, weight_ih[v_i0, v_i1], T.float16(0.0))
            with T.sblock("x_proj0_init_o"):
                v_b_o = T.axis.spatial(1, 0)
                v_n_o = T.axis.spatial(1, 0)
                T.reads()
                T.writes(x_proj0[0:48, 0:256])
                C = T.match_buffer(x_proj0[0:48, 0:256], (48, 256), offset_factor=1)
                T.evaluate(0)
            with T.sblock("x_proj0_update_o"):
                v_b_o = T.axis.spatial(1, 0)
                v_n_o = T.axis.spatial(1, 0)
                v_k_o = T.axis.reduce(1, 0)
                T.reads(x_proj0[0:48, 0:256], x[0:48, 0:64], w_packed0[0:256, 0:64])
                T.writes(x_proj0[0:48, 0:256])
                A = T.match_buffer(x[0:48, 0:64], (48, 64), "float16", offset_factor=1)
                W = T.match_buffer(w_packed0[0:256, 0:64], (256, 64), "float16", offset_factor=1)
                C = T.match_buffer(x_proj0[0:48, 0:256], (48, 256), offset_factor=1)
                bx = T.launch_thread("blockIdx.x", 4)
                tx = T.launch_thread("threadIdx.x", 128)
                smem = T.alloc_buffer((32768,), "float16", scope="shared.dyn")
                acc = T.alloc_local((32,))
                a_desc = T.alloc_local((1,), "uint64")
                w_desc = T.alloc_local((1,), "uint64")
                for s in T.unroll(3):
                    if s < 1:
                        for i in T.unroll(4):
                            T.ptx.cp(T.cuda.cvta_generic_to_shared(T.address_of(smem[s * 8192 + (tx + i * 128) // 8 * 64 + ((tx + i * 128) % 8 ^ (tx + i * 128) // 8 % 8) * 8])), T.address_of(A[T.min(bx // 4 * 64 + (tx + i * 128) // 8, 47), s * 64 + (tx + i * 128) % 8 * 8]), 16, T.if_then_else(bx // 4 * 64 + (tx + i * 128) // 8 < 48, T.uint32(16), T.uint32(0)), "async", "cg", "shared", "global", "", "", "")
                        for i in T.unroll(4):
                            T.ptx.cp(T.cuda.cvta_generic_to_shared(T.address_of(smem[s * 8192 + 4096 + (tx + i * 128) // 8 * 64 + ((tx + i * 128) % 8 ^ (tx + i * 128) // 8 % 8) * 8])), T.address_of(W[bx % 4 * 64 + (tx + i * 128) // 8, s * 64 + (tx + i * 128) % 8 * 8]), 16, T.uint32(16), "async", "cg", "shared", "global", "", "", "")
                    T.ptx.cp("async", "commit_group", "")
                for i in T.unroll(32):
                    acc[i] = T.float32(0.0)
                T.cuda.wgmma.encode_matrix_descriptor(T.address_of(a_desc[0]), T.address_of(smem[tx // 128 * 64 * 64]), 1, 64, 3)
                T.cuda.wgmma.encode_matrix_descriptor(T.address_of(w_desc[0]), T.address_of(smem[4096]), 1, 64, 3)
                for kt in range(1):
                    T.ptx.cp(2, "async", "wait_group", "")
                    T.ptx.fence("proxy", "async", "shared::cta", "")
                    T.tvm_storage_sync("shared", T.bool(False), -1)
                    if kt + 3 < 1:
                        for i in T.unroll(4):
                            T.ptx.cp(T.cuda.cvta_generic_to_shared(T.address_of(smem[(kt + 3) % 4 * 8192 + (tx + i * 128) // 8 * 64 + ((tx + i * 128) % 8 ^ (tx + i * 128) // 8 % 8) * 8])), T.address_of(A[T.min(bx // 4 * 64 + (tx + i * 128) // 8, 47), (kt + 3) * 64 + (tx + i * 128) % 8 * 8]), 16, T.if_then_else(bx // 4 * 64 + (tx + i * 128) // 8 < 48, T.uint32(16), T.uint32(0)), "async", "cg", "shared", "global", "", "", "")
                        for i in T.unroll(4):
                            T.ptx.cp(T.cuda.cvta_generic_to_shared(T.address_of(smem[(kt + 3) % 4 * 8192 + 4096 + (tx + i * 128) // 8 * 64 + ((tx + i * 128) % 8 ^ (tx + i * 128) // 8 % 8) * 8])), T.address_of(W[bx % 4 * 64 + (tx + i * 128) // 8, (kt + 3) * 64 + (tx + i * 128) % 8 * 8]), 16, T.uint32(16), "async", "cg", "shared", "global", "", "", "")
                    T.ptx.cp("async", "commit_group", "")
                    T.ptx.wgmma("fence", "sync", "aligned", "")
                    for kk in T.unroll(4):
                        T.ptx.wgmma(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7], acc[8], acc[9], acc[10], acc[11], acc[12], acc[13], acc[14], acc[15], acc[16], acc[17], acc[18], acc[19], acc[20], acc[21], acc[22], acc[23], acc[24], acc[25], acc[26], acc[27], acc[28], acc[29], acc[30], acc[31], a_desc[0] + T.Cast("uint64", (kt % 4 * 8192 * 2 + kk * 32) // 16), w_desc[0] + T.Cast("uint64", (kt % 4 * 8192 * 2 + kk * 32) // 16), kt > 0 or kk > 0, 1, 1, 0, 0, "mma_async", "sync", "aligned", "m64n64k16", "f32", "f16", "f16", "p34")
                    T.ptx.wgmma("commit_group", "sync", "aligned", "")
                    T.ptx.wgmma(0, "wait_group", "sync", "aligned", "")
                T.ptx.wgmma(0, "wait_group", "sync", "aligned", "")
                for j in T.unroll(16):
                    if bx // 4 * 64 + tx // 128 * 64 + tx % 128 // 32 * 16 + tx % 32 // 4 + j % 2 * 8 < 48:
                        C[bx // 4 * 64 + tx // 128 * 64 + tx % 128 // 32 * 16 + tx % 32 // 4 + j % 2 * 8, bx % 4 * 64 + j // 2 * 8 + tx % 32 % 4 * 2:bx % 4 * 64 + j // 2 * 8 + tx % 32 % 4 * 2 + 2] = acc[T.Ramp(2 * j, 1, 2)]
            for i0_i1_0_fused_0 in T.thread_binding(8, thread="blockIdx.x"):
                for i0_i1_0_fused_1 in T.thread_binding(256, thread="threadIdx.x"):
                    for i1_1 in T.vectorized(8):
                        with T.sblock("w_packed1"):
                            v_i0 = T.axis.spatial(256, (i0_i1_0_fused_0 * 256 + i0_i1_0_fused_1) // 8)
                            v_i1 = T.axis.spatial(64, (i0_i1_0_fused_0 * 256 + i0_i1_0_fused_1) % 8 * 8 + i1_1)
                            T.reads(weight_hh[v_i0, v_i1])
                            T.writes(w_packed1[v_i0, v_i1])
                            w_packed1[v_i0, v_i1] = T.if_then_else(v_i0 < 256, weight_hh[v_i0, v_i1], T.float16(0.0))
            for i0_m_i1_m_0_fused_0 in T.thread_binding(1, thread="blockIdx.x"):
                for i0_m_i1_m_0_fused_1 in T.thread_binding(256, thread="threadIdx.x"):
                    for i1_m_1 in T.vectorized(8):
                        with T.sblock("h_init"):
                            v_i0 = T.axis.spatial(16, (i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1) // 8)
                            v_i1 = T.axis.spatial(64, (i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1) % 8 * 8 + i1_m_1)
                            T.where(i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1 < 128)
                            T.reads(h0[v_i0, v_i1])
                            T.writes(h_init[v_i0, v_i1])
                            h_init[v_i0, v_i1] = h0[v_i0, v_i1]
                        with T.sblock("c_init"):
                            v_i0 = T.axis.spatial(16, (i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1) // 8)
                            v_i1 = T.axis.spatial(64, (i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1) % 8 * 8 + i1_m_1)
                            T.where(i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1 < 128)
                            T.reads(c0[v_i0, v_i1])
                            T.writes(c_init[v_i0, v_i1])
                            c_init[v_i0, v_i1] = c0[v_i0, v_i1]
        for t in range(3):
            with T.sblock("step"):
                T.reads(x_proj0[t * 16:t * 16 + 16, 0:256], bias_ih[0:256], h_seq[t * 16:t * 16 + 16, 0:64], w_packed1[0:256, 0:64], bias_hh[0:256], c_seq[t * 16:t * 16 + 16, 0:64])
                T.writes(h_seq[t * 16 + 16:t * 16 + 16 + 16, 0:64], c_seq[t * 16 + 16:t * 16 + 16 + 16, 0:64])
                gemm0 = T.sblock_alloc_buffer((16, 256))
                x_proj0_t = T.match_buffer(x_proj0[t * 16:t * 16 + 16, 0:256], (16, 256), offset_factor=1)
                h_t = T.match_buffer(h_seq[t * 16:t * 16 + 16, 0:64], (16, 64), "float16", offset_factor=1)
                c_t = T.match_buffer(c_seq[t * 16:t * 16 + 16, 0:64], (16, 64), "float16", offset_factor=1)
                h_next = T.match_buffer(h_seq[t * 16 + 16:t * 16 + 16 + 16, 0:64], (16, 64), "float16", offset_factor=1)
                c_next = T.match_buffer(c_seq[t * 16 + 16:t * 16 + 16 + 16, 0:64], (16, 64), "float16", offset_factor=1)
                with T.sblock("gemm0_init_o"):
                    v_b_o = T.axis.spatial(1, 0)
                    v_n_o = T.axis.spatial(1, 0)
                    T.reads()
                    T.writes(gemm0[0:16, 0:256])
                    C = T.match_buffer(gemm0[0:16, 0:256], (16, 256), offset_factor=1)
                    T.evaluate(0)
                with T.sblock("gemm0_update_o"):
                    v_b_o = T.axis.spatial(1, 0)
                    v_n_o = T.axis.spatial(1, 0)
                    v_k_o = T.axis.reduce(1, 0)
                    T.reads(gemm0[0:16, 0:256], h_t[0:16, 0:64], w_packed1[0:256, 0:64])
                    T.writes(gemm0[0:16, 0:256])
                    A = T.match_buffer(h_t[0:16, 0:64], (16, 64), "float16", offset_factor=1)
                    W = T.match_buffer(w_packed1[0:256, 0:64], (256, 64), "float16", offset_factor=1)
                    C = T.match_buffer(gemm0[0:16, 0:256], (16, 256), offset_factor=1)
                    bx = T.launch_thread("blockIdx.x", 4)
                    tx = T.launch_thread("threadIdx.x", 128)
                    smem = T.alloc_buffer((32768,), "float16", scope="shared.dyn")
                    acc = T.alloc_local((32,))
                    a_desc = T.alloc_local((1,), "uint64")
                    w_desc = T.alloc_local((1,), "uint64")
                    for s in T.unroll(3):
                        if s < 1:
                            for i in T.unroll(4):
                                T.ptx.cp(T.cuda.cvta_generic_to_shared(T.address_of(smem[s * 8192 + (tx + i * 128) // 8 * 64 + ((tx + i * 128) % 8 ^ (tx + i * 128) // 8 % 8) * 8])), T.address_of(A[T.min(bx // 4 * 64 + (tx + i * 128) // 8, 15), s * 64 + (tx + i * 128) % 8 * 8]), 16, T.if_then_else(bx // 4 * 64 + (tx + i * 128) // 8 < 16, T.uint32(16), T.uint32(0)), "async", "cg", "shared", "global", "", "", "")
                            for i in T.unroll(4):
                                T.ptx.cp(T.cuda.cvta_generic_to_shared(T.address_of(smem[s * 8192 + 4096 + (tx + i * 128) // 8 * 64 + ((tx + i * 128) % 8 ^ (tx + i * 128) // 8 % 8) * 8])), T.address_of(W[bx % 4 * 64 + (tx + i * 128) // 8, s * 64 + (tx + i * 128) % 8 * 8]), 16, T.uint32(16), "async", "cg", "shared", "global", "", "", "")
                        T.ptx.cp("async", "commit_group", "")
                    for i in T.unroll(32):
                        acc[i] = T.float32(0.0)
                    T.cuda.wgmma.encode_matrix_descriptor(T.address_of(a_desc[0]), T.address_of(smem[tx // 128 * 64 * 64]), 1, 64, 3)
                    T.cuda.wgmma.encode_matrix_descriptor(T.address_of(w_desc[0]), T.address_of(smem[4096]), 1, 64, 3)
                    for kt in range(1):
                        T.ptx.cp(2, "async", "wait_group", "")
                        T.ptx.fence("proxy", "async", "shared::cta", "")
                        T.tvm_storage_sync("shared", T.bool(False), -1)
                        if kt + 3 < 1:
                            for i in T.unroll(4):
                                T.ptx.cp(T.cuda.cvta_generic_to_shared(T.address_of(smem[(kt + 3) % 4 * 8192 + (tx + i * 128) // 8 * 64 + ((tx + i * 128) % 8 ^ (tx + i * 128) // 8 % 8) * 8])), T.address_of(A[T.min(bx // 4 * 64 + (tx + i * 128) // 8, 15), (kt + 3) * 64 + (tx + i * 128) % 8 * 8]), 16, T.if_then_else(bx // 4 * 64 + (tx + i * 128) // 8 < 16, T.uint32(16), T.uint32(0)), "async", "cg", "shared", "global", "", "", "")
                            for i in T.unroll(4):
                                T.ptx.cp(T.cuda.cvta_generic_to_shared(T.address_of(smem[(kt + 3) % 4 * 8192 + 4096 + (tx + i * 128) // 8 * 64 + ((tx + i * 128) % 8 ^ (tx + i * 128) // 8 % 8) * 8])), T.address_of(W[bx % 4 * 64 + (tx + i * 128) // 8, (kt + 3) * 64 + (tx + i * 128) % 8 * 8]), 16, T.uint32(16), "async", "cg", "shared", "global", "", "", "")
                        T.ptx.cp("async", "commit_group", "")
                        T.ptx.wgmma("fence", "sync", "aligned", "")
                        for kk in T.unroll(4):
                            T.ptx.wgmma(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7], acc[8], acc[9], acc[10], acc[11], acc[12], acc[13], acc[14], acc[15], acc[16], acc[17], acc[18], acc[19], acc[20], acc[21], acc[22], acc[23], acc[24], acc[25], acc[26], acc[27], acc[28], acc[29], acc[30], acc[31], a_desc[0] + T.Cast("uint64", (kt % 4 * 8192 * 2 + kk * 32) // 16), w_desc[0] + T.Cast("uint64", (kt % 4 * 8192 * 2 + kk * 32) // 16), kt > 0 or kk > 0, 1, 1, 0, 0, "mma_async", "sync", "aligned", "m64n64k16", "f32", "f16", "f16", "p34")
                        T.ptx.wgmma("commit_group", "sync", "aligned", "")
                        T.ptx.wgmma(0, "wait_group", "sync", "aligned", "")
                    T.ptx.wgmma(0, "wait_group", "sync", "aligned", "")
                    for j in T.unroll(16):
                        if bx // 4 * 64 + tx // 128 * 64 + tx % 128 // 32 * 16 + tx % 32 // 4 + j % 2 * 8 < 16:
                            C[bx // 4 * 64 + tx // 128 * 64 + tx % 128 // 32 * 16 + tx % 32 // 4 + j % 2 * 8, bx % 4 * 64 + j // 2 * 8 + tx % 32 % 4 * 2:bx % 4 * 64 + j // 2 * 8 + tx % 32 % 4 * 2 + 2] = acc[T.Ramp(2 * j, 1, 2)]
                for i0_m_i1_m_0_fused_0 in T.thread_binding(1, thread="blockIdx.x"):
                    for i0_m_i1_m_0_fused_1 in T.thread_binding(256, thread="threadIdx.x"):
                        for i1_m_1 in T.vectorized(4):
                            with T.sblock("h_next"):
                                v_i0 = T.axis.spatial(16, (i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1) // 16)
                                v_i1 = T.axis.spatial(64, (i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1) % 16 * 4 + i1_m_1)
                                T.reads(x_proj0_t[v_i0, v_i1:v_i1 + 193], bias_ih[v_i1:v_i1 + 193], gemm0[v_i0, v_i1:v_i1 + 193], bias_hh[v_i1:v_i1 + 193], c_t[v_i0, v_i1])
                                T.writes(h_next[v_i0, v_i1])
                                h_next[v_i0, v_i1] = T.Cast("float16", T.sigmoid(x_proj0_t[v_i0, v_i1 + 192] + T.Cast("float32", bias_ih[v_i1 + 192]) + (gemm0[v_i0, v_i1 + 192] + T.Cast("float32", bias_hh[v_i1 + 192]))) * T.tanh(T.sigmoid(x_proj0_t[v_i0, v_i1 + 64] + T.Cast("float32", bias_ih[v_i1 + 64]) + (gemm0[v_i0, v_i1 + 64] + T.Cast("float32", bias_hh[v_i1 + 64]))) * T.Cast("float32", c_t[v_i0, v_i1]) + T.sigmoid(x_proj0_t[v_i0, v_i1] + T.Cast("float32", bias_ih[v_i1]) + (gemm0[v_i0, v_i1] + T.Cast("float32", bias_hh[v_i1]))) * T.tanh(x_proj0_t[v_i0, v_i1 + 128] + T.Cast("float32", bias_ih[v_i1 + 128]) + (gemm0[v_i0, v_i1 + 128] + T.Cast("float32", bias_hh[v_i1 + 128])))))
                            with T.sblock("c_next"):
                                v_i0 = T.axis.spatial(16, (i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1) // 16)
                                v_i1 = T.axis.spatial(64, (i0_m_i1_m_0_fused_0 * 256 + i0_m_i1_m_0_fused_1) % 16 * 4 + i1_m_1)
                                T.reads(x_proj0_t[v_i0, v_i1:v_i1 + 129], bias_ih[v_i1:v_i1 + 129], gemm0[v_i0, v_i1:v_i1 + 129], bias_hh[v_i1:v_i1 + 129], c_t[v_i0, v_i1])
                                T.writes(c_next[v_i0, v_i1])
                                c_next[v_i0, v_i1] = T.Cast("float16", T.sigmoid(x_proj0_t[v_i0, v_i1 + 64] + T.Cast("float32", bias_ih[v_i1 + 64]) + (gemm0[v_i0, v_i1 + 64] + T.Cast("float32", bias_hh[v_i1 + 64]))) * T.Cast("float32", c_t[v_i0, v_i1]) + T.sigmoid(x_proj0_t[v_i0, v_i1] + T.Cast("float32", bias_ih[v_i1]) + (gemm0[v_i0, v_i1] + T.Cast("float32", bias_hh[v_i1]))) * T.tanh(x_proj0_t[v_i0, v_i1 + 128] + T.Cast("float32", bias_ih[v_i1 + 128]) + (gemm0[v_i0, v_i1 + 128] + T.Cast("float32", bias_hh[v_i1 + 128]))))
