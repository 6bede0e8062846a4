//! Address handles (`ibv_ah`): `ibv_create_ah`, `ibv_init_ah_from_wc` and `ibv_create_ah_from_wc`. An mlx5
//! address handle is host memory only (the `mlx5_av` a UD send carries; `mlx5_ib_create_ah` sends no command),
//! but it belongs to its PD, which counts it as Linux's `ib_create_ah` does.

use std::marker::PhantomData;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use mlx5_core::ah::{init_ah_from_wc, SgidType, GRH_BYTES};
use mlx5_core::cq::{LinkLayer, WorkCompletion};
use mlx5_core::hca::GidType;
use mlx5_core::qp::{Ah, AhAttr, UdDest};

use crate::context::Context;
use crate::error::{Result, VerbsError};
use crate::event::lock;
use crate::pd::{PdObj, ProtectionDomain};

/// An address handle without borrows: the address vector, the attributes it was made from, and its PD (counted
/// until the handle is dropped).
#[derive(Debug)]
pub(crate) struct AhObj {
    pd: Arc<PdObj>,
    pub(crate) ah: Ah,
    pub(crate) attr: AhAttr,
}

impl AhObj {
    /// `ibv_create_ah` as mlx5_ib's `create_ib_ah` builds it: the rate mapped for the device and, on RoCE, the
    /// source GID entry's type choosing the UDP source port and the ECN bit. A RoCE address without a GRH, or a
    /// rate that is not an `ibv_rate`, is refused (`EINVAL`).
    pub(crate) fn create(pd: &Arc<PdObj>, attr: &AhAttr) -> Result<Arc<AhObj>> {
        let mut c = pd.ctx.dev.control();
        if lock(&pd.pd).is_none() {
            return Err(VerbsError::Destroyed { what: "protection domain" });
        }
        let ah = c.hca().create_ah(attr)?;
        pd.users.fetch_add(1, Ordering::AcqRel);
        Ok(Arc::new(AhObj { pd: pd.clone(), ah, attr: *attr }))
    }
}

impl Drop for AhObj {
    fn drop(&mut self) {
        // Under the control mutex, as every change of a PD's count.
        let _c = self.pd.ctx.dev.control();
        self.pd.users.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An address handle for UD sends (`ibv_ah`). It borrows its PD, so the PD outlives it.
#[derive(Debug)]
pub struct AddressHandle<'pd> {
    pub(crate) obj: Arc<AhObj>,
    _pd: PhantomData<&'pd ()>,
}

impl AddressHandle<'_> {
    /// A UD destination through this handle.
    pub fn dest(&self, remote_qpn: u32, remote_qkey: u32) -> UdDest<'_> {
        UdDest { ah: &self.obj.ah, remote_qpn, remote_qkey }
    }

    /// The address vector UD sends carry (what an extended QP's `wr_set_ud_addr` copies).
    pub fn av(&self) -> &Ah {
        &self.obj.ah
    }

    /// The attributes the handle was made from.
    pub fn attr(&self) -> AhAttr {
        self.obj.attr
    }

    /// `ibv_destroy_ah` (dropping the handle does the same; an mlx5 address handle has no firmware object).
    pub fn destroy(self) {}
}

impl Drop for AddressHandle<'_> {
    /// The PD's count falls when the last reference to the handle's object goes. Having a `Drop` makes the borrow
    /// checker keep the PD borrowed until the handle is dropped, so `ProtectionDomain::destroy` cannot meet it.
    fn drop(&mut self) {}
}

impl<'ctx> ProtectionDomain<'ctx> {
    /// `ibv_create_ah`.
    ///
    /// ```
    /// use mlx5_verbs::{AhAttr, Context, Grh};
    /// let ctx = Context::open_sim()?;
    /// let pd = ctx.alloc_pd()?;
    /// let gid = ctx.query_gid(0)?;
    /// let attr = AhAttr { grh: Some(Grh { dgid: gid, hop_limit: 64, ..Grh::default() }), port_num: 1, ..AhAttr::default() };
    /// let ah = pd.create_ah(&attr)?;
    /// assert_eq!(ah.attr(), attr);
    /// // A RoCE address needs a GRH.
    /// assert!(pd.create_ah(&AhAttr { port_num: 1, ..AhAttr::default() }).is_err());
    /// # Ok::<(), mlx5_verbs::VerbsError>(())
    /// ```
    pub fn create_ah(&self, attr: &AhAttr) -> Result<AddressHandle<'_>> {
        Ok(AddressHandle { obj: AhObj::create(&self.obj, attr)?, _pd: PhantomData })
    }

    /// `ibv_create_ah_from_wc`: an address handle that answers the sender of the UD receive `wc`, whose first 40
    /// bytes of data were `grh` ([`Context::init_ah_from_wc`]). On RoCE the next hop's MAC is the one a
    /// link-local GID carries (this driver has no neighbour table; other GIDs are refused).
    pub fn create_ah_from_wc(
        &self,
        wc: &WorkCompletion,
        grh: Option<&[u8; GRH_BYTES]>,
        port_num: u8,
    ) -> Result<AddressHandle<'_>> {
        let mut attr = self.context().init_ah_from_wc(port_num, wc, grh)?;
        if self.context().link_layer() == LinkLayer::Ethernet {
            let g = attr.grh.ok_or_else(|| VerbsError::Invalid("a RoCE completion without a GRH".into()))?;
            if g.dgid[..8] != [0xfe, 0x80, 0, 0, 0, 0, 0, 0] {
                return Err(VerbsError::Invalid(
                    "the sender's GID is not link-local: its MAC cannot be derived (no neighbour table)".into(),
                ));
            }
            attr.dmac = crate::context::mac_of_gid(&g.dgid);
        }
        self.create_ah(&attr)
    }
}

impl Context {
    /// `ibv_init_ah_from_wc`: the address attributes that reach the sender of the UD receive `wc` from
    /// `port_num`. `grh` is the 40 bytes the device wrote in front of the data (required when `wc` has
    /// `WcFlags::GRH`); the source GID index is found in the port's GID table as `ibv_find_gid_index` finds it.
    ///
    /// ```
    /// use mlx5_verbs::{Context, WorkCompletion};
    /// let ctx = Context::open_sim()?;
    /// // Without a GRH only the completion's LID, SL and path bits are taken.
    /// let wc = WorkCompletion { slid: 5, sl: 2, ..WorkCompletion::default() };
    /// let ah = ctx.init_ah_from_wc(1, &wc, None)?;
    /// assert_eq!((ah.dlid, ah.sl, ah.grh), (5, 2, None));
    /// # Ok::<(), mlx5_verbs::VerbsError>(())
    /// ```
    pub fn init_ah_from_wc(&self, port_num: u8, wc: &WorkCompletion, grh: Option<&[u8; GRH_BYTES]>) -> Result<AhAttr> {
        let mut gid_tbl_len = None;
        let mut failure = None;
        let res = init_ah_from_wc(wc, grh, port_num, |gid, ty| {
            let len = match gid_tbl_len {
                Some(l) => l,
                None => match self.query_port() {
                    Ok(p) => *gid_tbl_len.insert(p.gid_tbl_len),
                    Err(e) => {
                        failure = Some(e);
                        return None;
                    }
                },
            };
            (0..len).find_map(|i| {
                let (g, t) = self.query_gid_ex(i).ok()?;
                let fits = match ty {
                    SgidType::IbOrRoceV1 => matches!(t, GidType::Ib | GidType::RoceV1),
                    SgidType::RoceV2 => t == GidType::RoceV2,
                };
                (fits && &g == gid).then(|| u8::try_from(i).ok()).flatten()
            })
        });
        if let Some(e) = failure {
            return Err(e);
        }
        res.map_err(VerbsError::AhFromWc)
    }
}
