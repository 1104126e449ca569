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
        w_packed1 = T.alloc_buffer((3, 16, 16))
        with T.sblock("prologue"):
            T.reads(weight_ih[0:48, 0:8], x[0:6, 0:8], weight_hh[0:48, 0:16], h0[0:2, 0:16])
            T.writes(x_proj0[0:6, 0:48], w_packed1[0:3, 0:16, 0:16], h_seq[0:2, 0:16])
            w_packed0 = T.sblock_alloc_buffer((3, 8, 16))
            x_proj0_local = T.sblock_alloc_buffer((6, 48), scope="local")
            h_init = T.match_buffer(h_seq[0:2, 0:16], (2, 16), offset_factor=1)
            for i0 in T.parallel(3):
                for i1, i2_0 in T.grid(8, 2):
                    for i2_1 in T.vectorized(8):
                        with T.sblock("w_packed0"):
                            v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                            v_i2 = T.axis.spatial(16, i2_0 * 8 + i2_1)
                            T.reads(weight_ih[v_i0 * 16 + v_i2, v_i1])
                            T.writes(w_packed0[v_i0, v_i1, v_i2])
                            w_packed0[v_i0, v_i1, v_i2] = T.if_then_else(v_i0 * 16 + v_i2 < 48, weight_ih[v_i0 * 16 + v_i2, v_i1], T.float32(0.0))
            for b_0_n_0_b_1_fused in T.parallel(6):
                for b_2_init in T.unroll(4):
                    for n_1_init in T.vectorized(16):
                        with T.sblock("x_proj0_init"):
                            v_b = T.axis.spatial(6, b_0_n_0_b_1_fused // 3 * 4 + b_2_init)
                            v_n = T.axis.spatial(48, b_0_n_0_b_1_fused % 3 * 16 + n_1_init)
                            T.where(T.Add(b_0_n_0_b_1_fused // 3, 0) * 4 + b_2_init < 6)
                            T.reads()
                            T.writes(x_proj0_local[v_b, v_n])
                            x_proj0_local[v_b, v_n] = T.float32(0.0)
                for k in range(8):
                    for b_2 in T.unroll(4):
                        for n_1 in T.vectorized(16):
                            with T.sblock("x_proj0_update"):
                                v_b = T.axis.spatial(6, b_0_n_0_b_1_fused // 3 * 4 + b_2)
                                v_n = T.axis.spatial(48, b_0_n_0_b_1_fused % 3 * 16 + n_1)
                                v_k = T.axis.reduce(8, k)
                                T.where(T.Add(b_0_n_0_b_1_fused // 3, 0) * 4 + b_2 < 6)
                                T.reads(x_proj0_local[v_b, v_n], x[v_b, v_k], w_packed0[v_n // 16, v_k, v_n % 16])
                                T.writes(x_proj0_local[v_b, v_n])
                                x_proj0_local[v_b, v_n] = x_proj0_local[v_b, v_n] + x[v_b, v_k] * w_packed0[v_n // 16, v_k, v_n % 16]
                for ax0 in range(4):
                    for ax1 in T.vectorized(16):
                        with T.sblock("x_proj0_local"):
                            v0 = T.axis.spatial(6, b_0_n_0_b_1_fused // 3 * 4 + ax0)
                            v1 = T.axis.spatial(48, b_0_n_0_b_1_fused % 3 * 16 + ax1)
                            T.where(b_0_n_0_b_1_fused // 3 * 4 + ax0 < 6)
                            T.reads(x_proj0_local[v0, v1])
                            T.writes(x_proj0[v0, v1])
                            x_proj0[v0, v1] = x_proj0_local[v0, v1]
            for i0 in T.parallel(3):
                for i1, i2_0 in T.grid(16, 2):
                    for i2_1 in T.vectorized(8):
                        with T.sblock("w_packed1"):
                            v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                            v_i2 = T.axis.spatial(16, i2_0 * 8 + i2_1)
                            T.reads(weight_hh[v_i0 * 16 + v_i2, v_i1])
                            T.writes(w_packed1[v_i0, v_i1, v_i2])
                            w_packed1[v_i0, v_i1, v_i2] = T.if_then_else(v_i0 * 16 + v_i2 < 48, weight_hh[v_i0 * 16 + v_i2, v_i1], T.float32(0.0))
            for i0 in T.parallel(2):
                for i1_0 in range(2):
                    for i1_1 in T.vectorized(8):
                        with T.sblock("h_init"):
                            v_i0 = T.axis.spatial(2, i0)
                            v_i1 = T.axis.spatial(16, i1_0 * 8 + i1_1)
                            T.reads(h0[v_i0, v_i1])
                            T.writes(h_init[v_i0, v_i1])
                            h_init[v_i0, v_i1] = h0[v_i0, v_i1]
        for t in range(3):
            with T.sblock("step"):
                T.reads(x_proj0[t * 2:t * 2 + 2, 0:48], gamma_ih[0:48], bias_ih[0:48], h_seq[t * 2:t * 2 + 2, 0:16], w_packed1[0:3, 0:16, 0:16], gamma_hh[0:48], bias_hh[0:48])
                T.writes(h_seq[t * 2 + 2:t * 2 + 2 + 2, 0:16])
                x_proj0_weight_ih_sum = T.sblock_alloc_buffer((2,))
                x_proj0_weight_ih_sqdev = T.sblock_alloc_buffer((2,))
                gemm0 = T.sblock_alloc_buffer((2, 48))
                gemm0_weight_hh_sum = T.sblock_alloc_buffer((2,))
                gemm0_weight_hh_sqdev = T.sblock_alloc_buffer((2,))
                gemm0_local = T.sblock_alloc_buffer((2, 48), scope="local")
                x_proj0_weight_ih_sum_rf_local = T.sblock_alloc_buffer((2, 8), scope="local")
                x_proj0_weight_ih_sqdev_rf_local = T.sblock_alloc_buffer((2, 8), scope="local")
                gemm0_weight_hh_sum_rf_local = T.sblock_alloc_buffer((2, 8), scope="local")
                gemm0_weight_hh_sqdev_rf_local = T.sblock_alloc_buffer((2, 8), scope="local")
                x_proj0_t = T.match_buffer(x_proj0[t * 2:t * 2 + 2, 0:48], (2, 48), offset_factor=1)
                h_t = T.match_buffer(h_seq[t * 2:t * 2 + 2, 0:16], (2, 16), offset_factor=1)
                h_next = T.match_buffer(h_seq[t * 2 + 2:t * 2 + 2 + 2, 0:16], (2, 16), offset_factor=1)
                for b in T.parallel(2):
                    for k_0 in range(6):
                        for k_1 in T.vectorized(8):
                            with T.sblock("x_proj0_weight_ih_sum_rf"):
                                vk_1, v_b, vk_0 = T.axis.remap("SSR", [k_1, b, k_0])
                                T.reads(x_proj0_t[v_b, vk_0 * 8 + vk_1])
                                T.writes(x_proj0_weight_ih_sum_rf_local[v_b, vk_1])
                                with T.init():
                                    x_proj0_weight_ih_sum_rf_local[v_b, vk_1] = T.float32(0.0)
                                x_proj0_weight_ih_sum_rf_local[v_b, vk_1] = x_proj0_weight_ih_sum_rf_local[v_b, vk_1] + x_proj0_t[v_b, vk_0 * 8 + vk_1]
                    for ax0 in range(8):
                        with T.sblock("x_proj0_weight_ih_sum"):
                            vk_1, v_b = T.axis.remap("RS", [ax0, b])
                            T.reads(x_proj0_weight_ih_sum_rf_local[v_b, vk_1])
                            T.writes(x_proj0_weight_ih_sum[v_b])
                            with T.init():
                                x_proj0_weight_ih_sum[v_b] = T.float32(0.0)
                            x_proj0_weight_ih_sum[v_b] = x_proj0_weight_ih_sum[v_b] + x_proj0_weight_ih_sum_rf_local[v_b, vk_1]
                for b in T.parallel(2):
                    for k_0 in range(6):
                        for k_1 in T.vectorized(8):
                            with T.sblock("x_proj0_weight_ih_sqdev_rf"):
                                vk_1, v_b, vk_0 = T.axis.remap("SSR", [k_1, b, k_0])
                                T.reads(x_proj0_t[v_b, vk_0 * 8 + vk_1], x_proj0_weight_ih_sum[v_b])
                                T.writes(x_proj0_weight_ih_sqdev_rf_local[v_b, vk_1])
                                with T.init():
                                    x_proj0_weight_ih_sqdev_rf_local[v_b, vk_1] = T.float32(0.0)
                                x_proj0_weight_ih_sqdev_rf_local[v_b, vk_1] = x_proj0_weight_ih_sqdev_rf_local[v_b, vk_1] + (x_proj0_t[v_b, vk_0 * 8 + vk_1] - x_proj0_weight_ih_sum[v_b] / T.float32(48.0)) * (x_proj0_t[v_b, vk_0 * 8 + vk_1] - x_proj0_weight_ih_sum[v_b] / T.float32(48.0))
                    for ax0 in range(8):
                        with T.sblock("x_proj0_weight_ih_sqdev"):
                            vk_1, v_b = T.axis.remap("RS", [ax0, b])
                            T.reads(x_proj0_weight_ih_sqdev_rf_local[v_b, vk_1])
                            T.writes(x_proj0_weight_ih_sqdev[v_b])
                            with T.init():
                                x_proj0_weight_ih_sqdev[v_b] = T.float32(0.0)
                            x_proj0_weight_ih_sqdev[v_b] = x_proj0_weight_ih_sqdev[v_b] + x_proj0_weight_ih_sqdev_rf_local[v_b, vk_1]
                for b_0_n_0_b_1_fused in T.parallel(3):
                    for b_2_init in T.unroll(4):
                        for n_1_init in T.vectorized(16):
                            with T.sblock("gemm0_init"):
                                v_b = T.axis.spatial(2, b_2_init)
                                v_n = T.axis.spatial(48, b_0_n_0_b_1_fused * 16 + n_1_init)
                                T.where(T.Add(0, 0) * 4 + b_2_init < 2)
                                T.reads()
                                T.writes(gemm0_local[v_b, v_n])
                                gemm0_local[v_b, v_n] = T.float32(0.0)
                    for k in range(16):
                        for b_2 in T.unroll(4):
                            for n_1 in T.vectorized(16):
                                with T.sblock("gemm0_update"):
                                    v_b = T.axis.spatial(2, b_2)
                                    v_n = T.axis.spatial(48, b_0_n_0_b_1_fused * 16 + n_1)
                                    v_k = T.axis.reduce(16, k)
                                    T.where(T.Add(0, 0) * 4 + b_2 < 2)
                                    T.reads(gemm0_local[v_b, v_n], h_t[v_b, v_k], w_packed1[v_n // 16, v_k, v_n % 16])
                                    T.writes(gemm0_local[v_b, v_n])
                                    gemm0_local[v_b, v_n] = gemm0_local[v_b, v_n] + h_t[v_b, v_k] * w_packed1[v_n // 16, v_k, v_n % 16]
                    for ax0 in range(2):
                        for ax1 in T.vectorized(16):
                            with T.sblock("gemm0_local"):
                                v0 = T.axis.spatial(2, ax0)
                                v1 = T.axis.spatial(48, b_0_n_0_b_1_fused * 16 + ax1)
                                T.reads(gemm0_local[v0, v1])
                                T.writes(gemm0[v0, v1])
                                gemm0[v0, v1] = gemm0_local[v0, v1]
                for b in T.parallel(2):
                    for k_0 in range(6):
                        for k_1 in T.vectorized(8):
                            with T.sblock("gemm0_weight_hh_sum_rf"):
                                vk_1, v_b, vk_0 = T.axis.remap("SSR", [k_1, b, k_0])
                                T.reads(gemm0[v_b, vk_0 * 8 + vk_1])
                                T.writes(gemm0_weight_hh_sum_rf_local[v_b, vk_1])
                                with T.init():
                                    gemm0_weight_hh_sum_rf_local[v_b, vk_1] = T.float32(0.0)
                                gemm0_weight_hh_sum_rf_local[v_b, vk_1] = gemm0_weight_hh_sum_rf_local[v_b, vk_1] + gemm0[v_b, vk_0 * 8 + vk_1]
                    for ax0 in range(8):
                        with T.sblock("gemm0_weight_hh_sum"):
                            vk_1, v_b = T.axis.remap("RS", [ax0, b])
                            T.reads(gemm0_weight_hh_sum_rf_local[v_b, vk_1])
                            T.writes(gemm0_weight_hh_sum[v_b])
                            with T.init():
                                gemm0_weight_hh_sum[v_b] = T.float32(0.0)
                            gemm0_weight_hh_sum[v_b] = gemm0_weight_hh_sum[v_b] + gemm0_weight_hh_sum_rf_local[v_b, vk_1]
                for b in T.parallel(2):
                    for k_0 in range(6):
                        for k_1 in T.vectorized(8):
                            with T.sblock("gemm0_weight_hh_sqdev_rf"):
                                vk_1, v_b, vk_0 = T.axis.remap("SSR", [k_1, b, k_0])
                                T.reads(gemm0[v_b, vk_0 * 8 + vk_1], gemm0_weight_hh_sum[v_b])
                                T.writes(gemm0_weight_hh_sqdev_rf_local[v_b, vk_1])
                                with T.init():
                                    gemm0_weight_hh_sqdev_rf_local[v_b, vk_1] = T.float32(0.0)
                                gemm0_weight_hh_sqdev_rf_local[v_b, vk_1] = gemm0_weight_hh_sqdev_rf_local[v_b, vk_1] + (gemm0[v_b, vk_0 * 8 + vk_1] - gemm0_weight_hh_sum[v_b] / T.float32(48.0)) * (gemm0[v_b, vk_0 * 8 + vk_1] - gemm0_weight_hh_sum[v_b] / T.float32(48.0))
                    for ax0 in range(8):
                        with T.sblock("gemm0_weight_hh_sqdev"):
                            vk_1, v_b = T.axis.remap("RS", [ax0, b])
                            T.reads(gemm0_weight_hh_sqdev_rf_local[v_b, vk_1])
                            T.writes(gemm0_weight_hh_sqdev[v_b])
                            with T.init():
                                gemm0_weight_hh_sqdev[v_b] = T.float32(0.0)
                            gemm0_weight_hh_sqdev[v_b] = gemm0_weight_hh_sqdev[v_b] + gemm0_weight_hh_sqdev_rf_local[v_b, vk_1]
                for i0 in T.parallel(2):
                    for i1_0 in range(2):
                        for i1_1 in T.vectorized(8):
                            with T.sblock("h_next"):
                                v_i0 = T.axis.spatial(2, i0)
                                v_i1 = T.axis.spatial(16, i1_0 * 8 + i1_1)
                                T.reads(x_proj0_t[v_i0, v_i1:v_i1 + 33], x_proj0_weight_ih_sum[v_i0], x_proj0_weight_ih_sqdev[v_i0], gamma_ih[v_i1:v_i1 + 33], bias_ih[v_i1:v_i1 + 33], gemm0[v_i0, v_i1:v_i1 + 33], gemm0_weight_hh_sum[v_i0], gemm0_weight_hh_sqdev[v_i0], gamma_hh[v_i1:v_i1 + 33], bias_hh[v_i1:v_i1 + 33], h_t[v_i0, v_i1])
                                T.writes(h_next[v_i0, v_i1])
                                h_next[v_i0, v_i1] = (T.float32(1.0) - T.sigmoid((x_proj0_t[v_i0, v_i1 + 16] - x_proj0_weight_ih_sum[v_i0] / T.float32(48.0)) * T.rsqrt(x_proj0_weight_ih_sqdev[v_i0] / T.float32(48.0) + T.float32(1.0000000000000001e-05)) * gamma_ih[v_i1 + 16] + bias_ih[v_i1 + 16] + ((gemm0[v_i0, v_i1 + 16] - gemm0_weight_hh_sum[v_i0] / T.float32(48.0)) * T.rsqrt(gemm0_weight_hh_sqdev[v_i0] / T.float32(48.0) + T.float32(1.0000000000000001e-05)) * gamma_hh[v_i1 + 16] + bias_hh[v_i1 + 16]))) * T.tanh((x_proj0_t[v_i0, v_i1 + 32] - x_proj0_weight_ih_sum[v_i0] / T.float32(48.0)) * T.rsqrt(x_proj0_weight_ih_sqdev[v_i0] / T.float32(48.0) + T.float32(1.0000000000000001e-05)) * gamma_ih[v_i1 + 32] + bias_ih[v_i1 + 32] + T.sigmoid((x_proj0_t[v_i0, v_i1] - x_proj0_weight_ih_sum[v_i0] / T.float32(48.0)) * T.rsqrt(x_proj0_weight_ih_sqdev[v_i0] / T.float32(48.0) + T.float32(1.0000000000000001e-05)) * gamma_ih[v_i1] + bias_ih[v_i1] + ((gemm0[v_i0, v_i1] - gemm0_weight_hh_sum[v_i0] / T.float32(48.0)) * T.rsqrt(gemm0_weight_hh_sqdev[v_i0] / T.float32(48.0) + T.float32(1.0000000000000001e-05)) * gamma_hh[v_i1] + bias_hh[v_i1])) * ((gemm0[v_i0, v_i1 + 32] - gemm0_weight_hh_sum[v_i0] / T.float32(48.0)) * T.rsqrt(gemm0_weight_hh_sqdev[v_i0] / T.float32(48.0) + T.float32(1.0000000000000001e-05)) * gamma_hh[v_i1 + 32] + bias_hh[v_i1 + 32])) + T.sigmoid((x_proj0_t[v_i0, v_i1 + 16] - x_proj0_weight_ih_sum[v_i0] / T.float32(48.0)) * T.rsqrt(x_proj0_weight_ih_sqdev[v_i0] / T.float32(48.0) + T.float32(1.0000000000000001e-05)) * gamma_ih[v_i1 + 16] + bias_ih[v_i1 + 16] + ((gemm0[v_i0, v_i1 + 16] - gemm0_weight_hh_sum[v_i0] / T.float32(48.0)) * T.rsqrt(gemm0_weight_hh_sqdev[v_i0] / T.float32(48.0) + T.float32(1.0000000000000001e-05)) * gamma_hh[v_i1 + 16] + bias_hh[v_i1 + 16])) * h_t[v_i0, v_i1]
